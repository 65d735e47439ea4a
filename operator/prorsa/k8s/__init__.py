"""Kubernetes side of the operator: CRD, object builders, the client, pod groups, agents."""
