"""A deterministic access log: a few hundred requests from a dozen clients, mixed statuses."""
import random

rng = random.Random(17)
clients = [f"10.0.{i // 4}.{i}" for i in range(12)]
weights = [1, 9, 3, 7, 2, 9, 4, 1, 6, 2, 5, 3]
for n in range(400):
    ip = rng.choices(clients, weights)[0]
    status = rng.choice([200, 200, 200, 301, 404, 404, 500])
    path = rng.choice(["/", "/index.html", "/missing", "/api/v1/items", "/favicon.ico"])
    print(f'{ip} - - [22/Nov/2026:10:{n // 60:02d}:{n % 60:02d} +0000] "GET {path} HTTP/1.1" {status} {rng.randint(100, 5000)}')
