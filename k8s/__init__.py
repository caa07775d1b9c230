"""Kubernetes: the sidecar injector webhook, the rollout orchestrator and the kustomize manifests."""
