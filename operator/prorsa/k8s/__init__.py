"""Kubernetes side of the operator: CRD, object builders, kopf handlers, switch executor."""
