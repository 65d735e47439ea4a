"""An in-process Kubernetes API server (:mod:`.emulator`) and the LeaderWorkerSet
controller that runs against it; see docs/testing.md for what it emulates.
"""
