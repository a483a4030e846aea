"""The `deploy:` section of pipeline.yaml: how the pipeline and service run on Kubernetes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class DeployConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = "modelship"
    image: str = "ghcr.io/modelship/modelship:0.1.0"
