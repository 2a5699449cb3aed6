"""Kubernetes: the DisaggregatedServingCluster resource (`schema.py`, `crd.py`), its checked
spec (`spec.py`), the manifests that run it (`render.py`, `pods.py`), and the operator: a pure
reconcile (`reconcile.py`, `status.py`, `role_labels.py`, `role_bounds.py`) behind thin kopf
handlers (`operator.py`, `driver.py`, `kube_api.py`). Torch-free; kopf and the Kubernetes
client are imported by `pdserve operator` only."""
