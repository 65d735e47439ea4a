"""Talking to the engine pods' agents (and the router they sit behind) over HTTP.

- :mod:`prorsa.engines.agents`: the agents' client (``/v1/state``, ``/v1/role``) and the
  router's, with each pod's address read off its manifest.
- :mod:`prorsa.engines.agent_tls`: the per-cluster CA and serving certificate the agents
  present, and the name the client checks; :mod:`prorsa.engines.agent_env`, the pod
  environment that says an agent serves HTTPS.

Neither reads the Kubernetes API: the pods they are given are plain manifests.
"""
