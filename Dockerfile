# The rollway image for compose.yaml. Built here, offline from registries: FROM the sandbox base image
# that scripts/setup-docker.sh builds from Debian packages; Python packages come from PyPI at build time
# (compose builds it with host networking). Runs as an unprivileged user.
# A host that reaches PyPI through a TLS proxy: put its CA bundle in .build/ca-certificates.crt
# (scripts/setup-docker.sh copies the system bundle there).
ARG BASE=rollway-sandbox:bookworm
FROM ${BASE}
COPY pyproject.toml .buil[d] /tmp/ctx/
RUN set -e; if [ -f /tmp/ctx/ca-certificates.crt ]; then export PIP_CERT=/tmp/ctx/ca-certificates.crt; fi; \
    python3 -m venv /opt/rollway; \
    python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/ctx/pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/ctx/requirements.txt; \
    /opt/rollway/bin/pip install -q --no-cache-dir -r /tmp/ctx/requirements.txt setuptools wheel
COPY . /app
RUN set -e; if [ -f /tmp/ctx/ca-certificates.crt ]; then export PIP_CERT=/tmp/ctx/ca-certificates.crt; fi; \
    /opt/rollway/bin/pip install -q --no-cache-dir --no-deps --no-build-isolation /app; \
    rm -rf /tmp/ctx /app/build; \
    echo 'rollway:x:10001:10001:rollway:/tmp:/usr/sbin/nologin' >> /etc/passwd; \
    echo 'rollway:x:10001:' >> /etc/group; \
    mkdir -p /runs && chown 10001:10001 /runs
ENV PATH=/opt/rollway/bin:/usr/local/bin:/usr/bin:/bin PYTHONUNBUFFERED=1 HOME=/tmp
WORKDIR /app
USER 10001:10001
