"""The Prorsa lab: what runs around the operator, never inside it.

The rollout simulator (:mod:`prorsa_lab.sim`), the benchmarks (:mod:`prorsa_lab.bench`),
the one-machine demo (:mod:`prorsa_lab.demo`) and the test doubles (:mod:`prorsa_lab.doubles`:
the Kubernetes API emulator, the fake kubelet, the SGLang engine double). The operator and
engine images leave this package out; the ``prorsa`` subcommands that need it
(``bench``, ``demo``, ``engine-double``) import it only when they run.
"""
