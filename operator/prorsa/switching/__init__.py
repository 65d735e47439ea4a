"""Carrying a switch out: the steps that flip one engine pod between prefill and decode.

The Controller decides which instance switches (a Decision); this package carries that
switch out on the pod, its router and its agent (the paper's Appendix C), and reports how
it ended. It sits above the Kubernetes adapter (:mod:`prorsa.k8s`), whose client, pod
groups and agent client it drives.
"""
