"""workflows/price-check.yaml written in Python (docs/tutorial.md, step 5): the same definition,
with the same digest. Use one or the other: to use this one, delete the YAML file and add
``workflow_modules: [pricewatch.flows]`` to the config (two definitions of one name are
refused)."""

from __future__ import annotations

from flowforge import Jitter, RetryPolicy, Workflow
from pricewatch.handlers import check_price, list_products, report

price_check = Workflow("price-check")
products = price_check.task("list_products", list_products)
prices = price_check.task(
    "check_price",
    check_price,
    for_each=products,
    max_parallel=4,
    retry=RetryPolicy(max_attempts=5, base_delay=1, max_delay=30, jitter=Jitter.FULL),
    timeout=20,
)
price_check.task("report", report, depends_on=[prices])
price_check.schedule(
    name="price-check-minutely",
    every="1m",
    input={"store": "demo", "skus": ["kettle", "toaster", "lamp", "desk", "chair", "mug"]},
)
