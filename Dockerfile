# Prorsa operator image: `prorsa operator` (kopf) with its runtime dependencies only.
#
# Build from the repository root:
#   docker build -t registry.example/prorsa-operator:0.1.0 .
# The Helm chart (charts/prorsa) runs it as
#   prorsa operator -A --listen 0.0.0.0:8787 --liveness http://0.0.0.0:8080/healthz ...
# with a read-only root filesystem as UID 10001.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# -- build: install the distribution with the `operator` extra (kopf, kubernetes) into a venv;
# no test, bench or aiconfigurator extras. Only the operator's source roots are copied: the
# operator, the wire contract, and the in-pod agent (`prorsa agent` is a subcommand of the
# same CLI; the operator never runs it, and engine pods run the engine image's light
# `prorsa-agent` distribution instead). The trainer SDK (sdk/prorsa_sdk) and the lab
# (tools/: simulator, benchmarks, demo, test doubles) stay out; setuptools installs what
# it finds.
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY sdk/prorsa_contract ./sdk/prorsa_contract
COPY engine_image/prorsa_agent ./engine_image/prorsa_agent
RUN python -m venv /opt/prorsa \
    && /opt/prorsa/bin/pip install --no-cache-dir ".[operator]" \
    && /opt/prorsa/bin/prorsa operator --help > /dev/null

# -- runtime: the venv on a clean slim base, unprivileged.
FROM ${PYTHON_IMAGE}

LABEL org.opencontainers.image.title="prorsa-operator" \
      org.opencontainers.image.description="Prorsa: forecast-driven prefill/decode role switching for agentic RL rollout" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid 10001 prorsa \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin prorsa

COPY --from=build /opt/prorsa /opt/prorsa

# No bytecode writes: the chart mounts the root filesystem read-only.
ENV PATH=/opt/prorsa/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

USER 10001:10001
WORKDIR /tmp

# 8787: trainer webhook and /metrics; 8080: kopf liveness (/healthz); 9443: admission (opt-in).
EXPOSE 8787 8080 9443

ENTRYPOINT ["prorsa"]
CMD ["operator", "-A"]
