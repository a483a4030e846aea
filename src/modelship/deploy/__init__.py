"""Kubernetes rendering of the pipeline (Argo Workflows) and the service."""
