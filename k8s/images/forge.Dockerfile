# The main image: `forge train` (the trainer Job), `forge inject serve` (the webhook) and `forge rollout --backend
# k8s` (the orchestrator). Built from requirements/main.txt, the same closure as the main environment (torch
# first, then the rest with --no-deps, as scripts/env.sh does). On GPUs, torch==2.13.0 resolves to the CUDA build.
#   docker build -f k8s/images/forge.Dockerfile -t openforge/forge:0.1.0 .
FROM python:3.11-slim-bookworm
COPY requirements/main.txt /opt/openforge/requirements.txt
RUN pip install --no-cache-dir "$(grep '^torch==' /opt/openforge/requirements.txt)" \
 && grep -v '^torch==' /opt/openforge/requirements.txt > /tmp/rest.txt \
 && pip install --no-cache-dir --no-deps -r /tmp/rest.txt && rm /tmp/rest.txt
COPY pyproject.toml README.md LICENSE /opt/openforge/src/
COPY forge /opt/openforge/src/forge
COPY sidecar /opt/openforge/src/sidecar
COPY collector /opt/openforge/src/collector
COPY trainer /opt/openforge/src/trainer
COPY k8s /opt/openforge/src/k8s
RUN pip install --no-cache-dir --no-deps --no-build-isolation /opt/openforge/src && rm -rf /opt/openforge/src/k8s/certs
ENV HF_HUB_OFFLINE=1
USER 65532:65532
ENTRYPOINT ["forge"]
