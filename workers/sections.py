"""The run config's sections about the store and the parties around it: what the
store keeps (retention), how the aggregator runs (shards) and where everyone is for
the bill (billing). Split from workers/config.py, which holds the rest."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from diloco.strict import names_unknown_fields
from storage import billing


class _Strict(BaseModel):
    """Rejects unknown fields with the list of allowed ones."""

    model_config = ConfigDict(extra="forbid")

    _known_fields = names_unknown_fields()


class RetentionConfig(_Strict):
    """What a run's store keeps, so that a bucket does not fill with what neither a
    resume nor an audit needs (``diloco gc``; applied when a run finishes)."""

    worker_checkpoints: int = Field(
        default=1, ge=1,
        description="checkpoints each worker keeps while it trains (the newest resumes it)",
    )
    contributions: int | Literal["all"] = Field(
        default=2,
        description="rounds per fragment whose outer-gradient payloads a finished run keeps "
                    "(the newest ones); the commit records, naming each payload's sha256, "
                    "norm and weight, always stay. 'all' keeps every payload, to recompute "
                    "every mean",
    )
    after_run: bool = Field(
        default=True,
        description="when a run finishes, delete what it no longer needs (worker "
                    "checkpoints, payloads beyond 'contributions', orphans)",
    )

    @field_validator("contributions")
    @classmethod
    def _non_negative(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 0:
            raise ValueError("contributions: a number of rounds >= 0, or 'all'")
        return v


class AggregatorConfig(_Strict):
    """How the aggregator runs: ``shards`` K processes, each owning a disjoint range of
    the zarr chunks of every fragment (diloco/shards.py); 1 is the single aggregator."""

    shards: int = Field(default=1, ge=1, le=64, description="K: aggregator processes, "
                        "each reducing its own chunks of every fragment")


class BillingConfig(_Strict):
    """Where the bucket and each party are, and the list prices that turn their
    traffic into dollars (`storage.billing`). Nothing set: every party is where the
    store is, no crossing, $0 of egress."""

    store: str = Field(default=billing.LOCAL,
                       description="provider:region of the bucket, e.g. aws:us-east-1")
    regions: dict[str, str] = Field(
        default_factory=dict,
        description="provider:region of each party (a worker's name, or aggregator); "
                    "default: the store's region",
    )
    prices: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="per provider, overrides of the default list prices "
                    "(egress_internet_gb, egress_inter_region_gb, class_a_per_1k, "
                    "class_b_per_1k)",
    )

    @field_validator("store")
    @classmethod
    def _store_region(cls, text: str) -> str:
        billing.parse_region(text)
        return text

    @field_validator("regions")
    @classmethod
    def _party_regions(cls, regions: dict[str, str]) -> dict[str, str]:
        for name, text in regions.items():
            try:
                billing.parse_region(text)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        return regions

    @field_validator("prices")
    @classmethod
    def _valid_prices(cls, prices: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        try:
            billing.price_table(prices)
        except ValueError as exc:
            raise ValueError(str(exc).removeprefix("prices.")) from None
        return prices

    def region_of(self, party: str) -> str:
        """The region of ``party`` (a worker's name, ``aggregator``, ``train``)."""
        return self.regions.get(party, self.store)

    def table(self) -> dict[str, billing.Prices]:
        """The price table: the defaults with this run's overrides."""
        return billing.price_table(self.prices)

    def meter(self, traffic: Any, party: str, before: dict[str, Any] | None = None
              ) -> billing.Meter:
        """A `billing.Meter` of ``party``'s traffic (cumulative from ``before``)."""
        return billing.Meter(traffic, party=self.region_of(party), store=self.store,
                             prices=self.table(), before=before)
