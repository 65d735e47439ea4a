"""The Kubernetes side of the operator: what talks to the API server or builds what it
stores.

The API client (``kube.py``), object manifests (``objects.py``), multi-node engine groups
and LeaderWorkerSets (``groups.py``, ``lws.py``), the CRD manifest (``crd_manifest.py``)
and manifests read from files (``manifest_file.py``), the leader's Lease (``leader.py``)
and the trainer tokens' Secret followed (``trainer_token.py``). The control loop that
drives them is :mod:`prorsa.control`, the switch executor :mod:`prorsa.switching`, the
agents' HTTP client :mod:`prorsa.engines`, the kopf handlers :mod:`prorsa.shell`.
"""
