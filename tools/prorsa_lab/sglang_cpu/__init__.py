"""The real SGLang 0.5.23 on a CPU, in the loop of the tests and ``prorsa demo --engine sglang``.

``environment`` finds the engine environment ``scripts/engine-env.sh`` builds
(``.venv-engine``, the CPU stand-ins of ``tests/real_engine/cpu``, the tiny model) and
assembles the command line of a CPU engine; ``sglang_pod`` runs one engine pod: the real
in-pod agent launching and supervising a real engine, as ``prorsa-agent --launch`` does in
the engine image. docs/testing.md says what each CPU stand-in is for.
"""
