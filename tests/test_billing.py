"""The egress bill: the price arithmetic by hand, per crossing and direction, the
price table's overrides, the request classes, and a meter that survives a restart."""

from __future__ import annotations

import pytest

from storage.billing import (
    ALIASES,
    DEFAULT_PRICES,
    PROVIDERS,
    Meter,
    bill,
    crossing,
    parse_region,
    price_table,
    request_classes,
)
from storage.traffic import TrafficCounter

P = DEFAULT_PRICES


def test_every_provider_has_dated_sourced_prices() -> None:
    assert set(DEFAULT_PRICES) == set(PROVIDERS)
    assert set(ALIASES.values()) <= set(PROVIDERS)
    for name, p in DEFAULT_PRICES.items():
        assert p.provider == name and p.read and p.source
    assert P["aws"].egress_internet_gb == 0.09 and P["cloudflare"].egress_internet_gb == 0.0


def test_parse_region_resolves_aliases_and_names_the_allowed_providers() -> None:
    assert parse_region("aws:us-east-1") == ("aws", "us-east-1")
    assert parse_region("s3:us-east-1") == ("aws", "us-east-1")
    assert parse_region("GCS:europe-west4") == ("gcp", "europe-west4")
    assert parse_region("r2:auto") == ("cloudflare", "auto")
    with pytest.raises(ValueError, match="allowed: aws, gcp, azure, cloudflare, other"):
        parse_region("ibm:us-south")
    with pytest.raises(ValueError, match="provider:region"):
        parse_region("aws")


def test_crossing_of_a_party() -> None:
    assert crossing("aws:us-east-1", "s3:us-east-1") == "none"
    assert crossing("aws:eu-west-1", "aws:us-east-1") == "inter-region"
    assert crossing("gcp:europe-west4", "aws:us-east-1") == "internet"
    assert crossing("other:local", "other:local") == "none"


def _bill(party: str, store: str, up: int = 3 * 10**9, down: int = 5 * 10**9,
          a: int = 2000, b: int = 10000) -> dict:
    return bill(bytes_up=up, bytes_down=down, class_a=a, class_b=b, party=party, store=store,
                prices=price_table())


def test_same_region_pays_only_requests_at_the_store_provider() -> None:
    got = _bill("aws:us-east-1", "aws:us-east-1")
    assert got["crossing"] == "none"
    assert got["egress_usd"] == 0.0
    assert got["requests_usd"] == pytest.approx(2 * 0.005 + 10 * 0.0004)
    assert got["total_usd"] == pytest.approx(0.014)


def test_inter_region_egress_both_ways_at_the_inter_region_rate() -> None:
    got = _bill("aws:eu-west-1", "aws:us-east-1")
    assert got["egress_down_usd"] == pytest.approx(5 * 0.02)  # the store's egress
    assert got["egress_up_usd"] == pytest.approx(3 * 0.02)  # the party's egress
    assert got["total_usd"] == pytest.approx(0.16 + 0.014)


def test_internet_down_is_the_stores_rate_up_is_the_partys() -> None:
    got = _bill("gcp:europe-west4", "aws:us-east-1")
    assert got["egress_down_usd"] == pytest.approx(5 * 0.09)  # out of S3
    assert got["egress_up_usd"] == pytest.approx(3 * 0.12)  # out of GCP
    assert got["requests_usd"] == pytest.approx(0.014)  # S3 bills the requests
    r2 = _bill("gcp:europe-west4", "r2:auto")
    assert r2["egress_down_usd"] == 0.0  # R2 charges no egress
    assert r2["egress_up_usd"] == pytest.approx(3 * 0.12)  # GCP still does
    assert r2["requests_usd"] == pytest.approx(2 * 0.0045 + 10 * 0.00036)
    onprem = _bill("other:lab", "aws:us-east-1")
    assert onprem["egress_up_usd"] == 0.0 and onprem["egress_down_usd"] == pytest.approx(0.45)


def test_price_table_overrides_one_field_and_marks_it() -> None:
    table = price_table({"s3": {"egress_internet_gb": 0.05}})
    assert table["aws"].egress_internet_gb == 0.05
    assert table["aws"].class_a_per_1k == 0.005
    assert "overridden" in table["aws"].read
    assert table["gcp"] == DEFAULT_PRICES["gcp"]
    with pytest.raises(ValueError, match="prices.aws: unknown field.*allowed: egress_internet_gb"):
        price_table({"aws": {"egress": 0.1}})
    with pytest.raises(ValueError, match="provider 'oracle' is not known"):
        price_table({"oracle": {"egress_internet_gb": 0.1}})
    with pytest.raises(ValueError, match="prices.aws.class_a_per_1k: a price >= 0"):
        price_table({"aws": {"class_a_per_1k": -1}})


def test_request_classes_of_every_store_operation() -> None:
    by_op = {"put": 3, "put_if_absent": 2, "list": 1, "get": 7, "exists": 4, "size": 1,
             "delete": 9}
    assert request_classes(by_op) == (6, 12)


def test_meter_counts_from_the_traffic_counter_and_carries_a_previous_life() -> None:
    t = TrafficCounter()
    t.record("put", "a/b", up=2 * 10**9)
    t.record("get", "a/b", down=10**9)
    t.record("delete", "a/b")
    status = TrafficCounter()  # another client of the same party: billed too
    status.record("put", "members/w/status.json", up=10**9)
    before = {"billed_bytes_up": 0, "billed_bytes_down": 0, "requests_a": 998, "requests_b": 1}
    m = Meter([t, status], party="gcp:europe-west4", store="aws:us-east-1", before=before)
    assert m.counts() == {"billed_bytes_up": 3 * 10**9, "billed_bytes_down": 10**9,
                          "requests_a": 1000, "requests_b": 2}
    f = m.figures()
    assert f["crossing"] == "internet"
    assert f["egress_up_usd"] == pytest.approx(3 * 0.12)
    assert f["egress_down_usd"] == pytest.approx(0.09)
    assert f["requests_usd"] == pytest.approx(0.005 + 2 * 0.0004 / 1000)
    assert f["cost_usd"] == pytest.approx(f["egress_usd"] + f["requests_usd"])
    assert Meter(TrafficCounter()).figures()["cost_usd"] == 0.0  # nothing configured: $0


@pytest.mark.parametrize("override, expected", [
    ("billing.store=ibm:us-south", "billing.store: provider 'ibm' is not known; allowed: aws, "
                                   "gcp, azure, cloudflare, other"),
    ("billing.regions={region-z: aws:us-east-1}", "billing.regions: unknown name(s) region-z; "
                                                  "known: region-a, region-b, aggregator"),
    ("billing.regions={region-a: aws}", "region-a: region 'aws': expected provider:region"),
    ("billing.prices={aws: {egress: 0.1}}", "aws: unknown field(s) egress; allowed: "
                                            "egress_internet_gb"),
])
def test_billing_config_errors_name_the_field(in_process, tmp_path, override, expected) -> None:
    from cli.app import app
    from workers.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert expected in str(err.value) and "\n" not in str(err.value)
    result = in_process.invoke(app, ["run", "--set", override])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0], result.stderr
    assert " ".join(expected.split()) in " ".join(result.stderr.split())
    assert not (tmp_path / "runs").exists()


def test_billing_config_resolves_regions_and_prices() -> None:
    from workers.config import load_config

    cfg = load_config(None, ["billing.store=s3:us-east-1",
                             "billing.regions={region-b: gcs:europe-west4}",
                             "billing.prices={gcp: {egress_internet_gb: 0.08}}"])
    b = cfg.billing
    assert b.region_of("region-a") == "s3:us-east-1"  # default: the store's region
    assert b.region_of("region-b") == "gcs:europe-west4"
    assert b.table()["gcp"].egress_internet_gb == 0.08
    t = TrafficCounter()
    t.record("put", "k", up=10**9)
    assert b.meter(t, "region-b").figures()["egress_up_usd"] == pytest.approx(0.08)
    assert b.meter(t, "region-a").figures()["egress_usd"] == 0.0
    assert load_config(None).billing.region_of("aggregator") == "other:local"
