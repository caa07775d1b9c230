# The sidecar image: what the injected containers run (`forge net-init`, `forge ca init`, `forge sidecar`) and the
# rollout verifier (`forge verify`). Built from requirements/sidecar.txt, the same closure as .venv-sidecar, on
# Debian's Python 3.11 so uid 1337 can run it. Build from the repository root:
#   docker build -f k8s/images/sidecar.Dockerfile -t openforge/sidecar:0.1.0 .
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv iptables ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY requirements/sidecar.txt /opt/openforge/requirements.txt
RUN python3 -m venv /opt/openforge/venv \
 && /opt/openforge/venv/bin/pip install --no-cache-dir --no-deps -r /opt/openforge/requirements.txt
# Only the packages the pod runs: the sidecar, the shared errors, and k8s/pod.py's command line.
COPY forge/__init__.py forge/errors.py forge/paths.py /opt/openforge/src/forge/
COPY sidecar /opt/openforge/src/sidecar
COPY k8s/__init__.py k8s/pod.py k8s/verify.py /opt/openforge/src/k8s/
RUN printf '#!/bin/sh\nexec /opt/openforge/venv/bin/python -m k8s.pod "$@"\n' > /usr/local/bin/forge \
 && chmod 755 /usr/local/bin/forge && chmod -R a+rX /opt/openforge
ENV PYTHONPATH=/opt/openforge/src FORGE_SIDECAR_VENV=/opt/openforge/venv PYTHONDONTWRITEBYTECODE=1
USER 1337:1337
ENTRYPOINT ["forge"]
