"""Each RolloutCluster's control loop, cut by role (kopf's reactor apart from its engines).

- :mod:`prorsa.control.runtime`: :class:`ClusterRuntime`, the loop itself (set-up,
  lifecycle, one tick) composing the parts below and carrying out the core's actions.
- :mod:`prorsa.control.reconcile`: engine pods and groups made to match the spec, role
  labels made to match what the agents report.
- :mod:`prorsa.control.polling`: every agent's state, once a tick.
- :mod:`prorsa.control.status`: the RolloutCluster's status, its conditions and the
  Events of a change; :mod:`prorsa.control.availability` judges the unavailable engines.
- :mod:`prorsa.control.metrics`: the operator's Prometheus series.
"""
