"""What a run's store traffic costs: list prices, region crossings, dollars per party.

Cross-region training is paid for in egress, so the bill is a result the product
reports beside the bytes (`storage.traffic`). The model:

- Each party (a worker, the aggregator) runs in a region and the store (the bucket)
  is in a region; a region is ``provider:region`` (``aws:us-east-1``), provider one
  of `PROVIDERS` (``other``: on-premises or unknown, no egress price of its own).
- The *crossing* of a party is ``none`` (same provider and region as the store),
  ``inter-region`` (same provider, another region) or ``internet`` (another provider).
- Bytes DOWN (store -> party) are egress of the store's provider at its rate for that
  crossing; bytes UP (party -> store) are egress of the party's provider at its rate
  for that crossing. Ingress is free everywhere.
- Requests are billed by the store's provider: class A (writes and listings) and
  class B (reads and metadata); deletes are free (`OP_CLASSES`). A failed attempt
  that was retried is not billed (transient errors are mostly 5xx/throttling, which
  the providers do not charge); the attempt that succeeded is.
- GB = 10^9 bytes. Free tiers and volume discounts are ignored: the first paid tier.

The defaults are the providers' published list prices, first tier, US regions,
standard storage class (`DEFAULT_PRICES`; each says when and where it was read).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from storage.traffic import TrafficCounter

PROVIDERS: tuple[str, ...] = ("aws", "gcp", "azure", "cloudflare", "other")
ALIASES: dict[str, str] = {"s3": "aws", "gcs": "gcp", "r2": "cloudflare"}
CROSSINGS: tuple[str, ...] = ("none", "inter-region", "internet")
#: where a party is when nothing is configured: the store's region, no crossing
LOCAL = "other:local"
GB = 1e9

#: how each operation the `TrafficCounter` records (``by_op``) is billed: class A
#: (writes, listings; a multipart part is a put), class B (reads, metadata), or free
OP_CLASSES: dict[str, str] = {
    "put": "A", "put_if_absent": "A", "list": "A",
    "get": "B", "exists": "B", "size": "B", "head_bucket": "B",
    "delete": "free",
}


@dataclass(frozen=True)
class Prices:
    """One provider's list prices (USD): egress per GB to the internet and to another
    region of the same provider, requests per 1,000; ``read`` is the date the figures
    were read and ``source`` the pricing page, so a bill says what it rests on."""

    provider: str
    egress_internet_gb: float
    egress_inter_region_gb: float
    class_a_per_1k: float
    class_b_per_1k: float
    read: str
    source: str

    def egress_gb(self, crossing_: str) -> float:
        """The egress price per GB of bytes leaving this provider over ``crossing_``."""
        return {"none": 0.0, "inter-region": self.egress_inter_region_gb,
                "internet": self.egress_internet_gb}[crossing_]


#: First pricing tier, US regions, standard storage class. S3: us-east-1, internet
#: egress "first 10 TB / month" (after the account-wide free 100 GB), inter-region
#: to another US region; requests PUT/COPY/POST/LIST and GET/SELECT. GCS: Standard
#: storage, premium network tier, internet egress to the Americas/EMEA as in Google's
#: own pricing example; inter-region within North America. Azure: Blob hot LRS,
#: bandwidth "first 10 TB" out of North America; transactions are published per
#: 10,000 (divided by 10 here); these Azure figures are as published in 2025, not
#: re-checked against the live page. R2: no egress fee of any kind.
DEFAULT_PRICES: dict[str, Prices] = {
    "aws": Prices("aws", 0.09, 0.02, 0.005, 0.0004, read="2026-11-25",
                  source="https://aws.amazon.com/s3/pricing/"),
    "gcp": Prices("gcp", 0.12, 0.02, 0.005, 0.0004, read="2026-11-25",
                  source="https://cloud.google.com/storage/pricing"),
    "azure": Prices("azure", 0.087, 0.02, 0.0065, 0.0005,
                    read="2025 (as published, not re-checked)",
                    source="https://azure.microsoft.com/pricing/details/storage/blobs/"),
    "cloudflare": Prices("cloudflare", 0.0, 0.0, 0.0045, 0.00036, read="2026-11-25",
                         source="https://developers.cloudflare.com/r2/pricing/"),
    "other": Prices("other", 0.0, 0.0, 0.0, 0.0, read="-",
                    source="on-premises or unknown: no price of its own"),
}

_PRICE_FIELDS = tuple(f.name for f in fields(Prices) if f.name != "provider")


def provider_name(text: str) -> str:
    """The canonical provider of ``text`` (an alias resolved), or ValueError."""
    name = ALIASES.get(text.strip().lower(), text.strip().lower())
    if name not in PROVIDERS:
        raise ValueError(f"provider {text!r} is not known; allowed: "
                         f"{', '.join(PROVIDERS)} (aliases {', '.join(ALIASES)})")
    return name


def parse_region(text: str) -> tuple[str, str]:
    """``"aws:us-east-1"`` -> ``("aws", "us-east-1")``; aliases (``s3``, ``gcs``,
    ``r2``) resolve. A bad provider or a missing region is a ValueError naming what
    is allowed."""
    provider, sep, region = str(text).partition(":")
    if not sep or not region.strip():
        raise ValueError(f"region {text!r}: expected provider:region, e.g. aws:us-east-1, "
                         f"provider one of {', '.join(PROVIDERS)}")
    return provider_name(provider), region.strip()


def crossing(party: str, store: str) -> str:
    """How the traffic between a party in region ``party`` and the store in region
    ``store`` crosses a boundary: ``none``, ``inter-region`` or ``internet``."""
    p, s = parse_region(party), parse_region(store)
    if p == s:
        return "none"
    return "inter-region" if p[0] == s[0] else "internet"


def price_table(overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Prices]:
    """The default table with per-provider ``overrides`` (``{"aws": {"egress_internet_gb":
    0.05}}``) applied; an unknown provider or field, or a negative price, is a
    ValueError naming it."""
    table = dict(DEFAULT_PRICES)
    for raw, changes in (overrides or {}).items():
        name = provider_name(raw)
        if not isinstance(changes, Mapping):
            raise ValueError(f"prices.{raw}: expected a mapping of {', '.join(_PRICE_FIELDS)}")
        unknown = sorted(set(changes) - set(_PRICE_FIELDS))
        if unknown:
            raise ValueError(f"prices.{raw}: unknown field(s) {', '.join(unknown)}; "
                             f"allowed: {', '.join(_PRICE_FIELDS)}")
        for key, value in changes.items():
            if key in ("read", "source"):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"prices.{raw}.{key}: a price >= 0 in USD, got {value!r}")
        clean = {k: (str(v) if k in ("read", "source") else float(v)) for k, v in changes.items()}
        if "read" not in clean and any(k not in ("read", "source") for k in clean):
            clean["read"] = f"{table[name].read}, overridden"
        table[name] = replace(table[name], **clean)
    return table


def request_classes(by_op: Mapping[str, int]) -> tuple[int, int]:
    """(class A, class B) request counts from ``TrafficCounter.snapshot()["by_op"]``;
    an operation not in `OP_CLASSES` is counted as class A (the dearer: a bill errs
    high rather than low)."""
    a = b = 0
    for op, n in by_op.items():
        kind = OP_CLASSES.get(op, "A")
        if kind == "A":
            a += int(n)
        elif kind == "B":
            b += int(n)
    return a, b


def bill(*, bytes_up: int, bytes_down: int, class_a: int, class_b: int, party: str,
         store: str, prices: Mapping[str, Prices]) -> dict[str, Any]:
    """The dollars of one party's traffic with the store (see the module docstring):
    ``egress_up_usd`` (the party's provider), ``egress_down_usd`` (the store's),
    ``requests_usd`` (the store's), ``egress_usd``, ``total_usd``, and the
    ``crossing`` and providers they rest on."""
    how = crossing(party, store)
    party_p, store_p = prices[parse_region(party)[0]], prices[parse_region(store)[0]]
    up = bytes_up / GB * party_p.egress_gb(how)
    down = bytes_down / GB * store_p.egress_gb(how)
    requests = class_a / 1000 * store_p.class_a_per_1k + class_b / 1000 * store_p.class_b_per_1k
    return {"egress_up_usd": up, "egress_down_usd": down, "egress_usd": up + down,
            "requests_usd": requests, "total_usd": up + down + requests, "crossing": how,
            "party": party, "store": store}


#: the counts a party carries across its restarts (in its status record): every body
#: byte and request of the party, its exchange, checkpoints and status writes alike
#: (``bytes_up``/``bytes_down`` in a status count the exchange only)
COUNT_KEYS: tuple[str, ...] = ("billed_bytes_up", "billed_bytes_down", "requests_a",
                               "requests_b")


class Meter:
    """One party's cumulative counts and their cost, across its restarts.

    ``traffic``: the counters of every store client of the party (its exchange, its
    checkpoints, its status board), all billed alike. A restarted process starts new
    counters; ``before`` (the counts its previous life recorded, e.g. its last
    status) is added so the bill of a resumed run is the whole run's."""

    def __init__(self, traffic: TrafficCounter | Sequence[TrafficCounter], *,
                 party: str = LOCAL, store: str = LOCAL,
                 prices: Mapping[str, Prices] | None = None,
                 before: Mapping[str, Any] | None = None) -> None:
        self.counters = [traffic] if isinstance(traffic, TrafficCounter) else list(traffic)
        self.party, self.store = party, store
        self.prices = dict(prices or DEFAULT_PRICES)
        self.before = {k: int((before or {}).get(k) or 0) for k in COUNT_KEYS}

    def counts(self) -> dict[str, int]:
        """Cumulative billed bytes up/down and class A/B requests."""
        now = dict.fromkeys(COUNT_KEYS, 0)
        for counter in self.counters:
            snap = counter.snapshot()
            a, b = request_classes(snap["by_op"])
            for key, n in zip(COUNT_KEYS, (snap["bytes_up"], snap["bytes_down"], a, b),
                              strict=True):
                now[key] += n
        return {k: self.before[k] + now[k] for k in COUNT_KEYS}

    def figures(self) -> dict[str, Any]:
        """`counts` plus ``cost_usd``, ``egress_usd``, ``egress_up_usd``,
        ``egress_down_usd``, ``requests_usd`` and the ``crossing``: what a status
        record and the tracking metrics carry."""
        c = self.counts()
        b = bill(bytes_up=c["billed_bytes_up"], bytes_down=c["billed_bytes_down"],
                 class_a=c["requests_a"], class_b=c["requests_b"], party=self.party,
                 store=self.store, prices=self.prices)
        return {**c, "cost_usd": b["total_usd"], "egress_usd": b["egress_usd"],
                "egress_up_usd": b["egress_up_usd"], "egress_down_usd": b["egress_down_usd"],
                "requests_usd": b["requests_usd"], "crossing": b["crossing"]}
