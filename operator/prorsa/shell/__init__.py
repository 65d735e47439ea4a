"""The processes around the control loops.

- :mod:`prorsa.shell.handlers`: the kopf handlers that assemble the operator from the
  adapters (a :class:`~prorsa.control.runtime.ClusterRuntime` per RolloutCluster, the
  webhook, the trainer tokens).
- :mod:`prorsa.shell.process`: ``prorsa operator``'s process: probes, ``/metrics``, leader
  election, kopf.
- :mod:`prorsa.shell.gc_tuning`: what every long-running server sets for the whole process
  (the operator's and ``prorsa ingest``'s garbage collector).
"""
