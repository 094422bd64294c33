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
from storage.traffic import TrafficCounter, human_bytes

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


def _by_hand(s: dict, up_rate: float, down_rate: float) -> float:
    """A party's dollars from its status counts, the model written out."""
    return (s["billed_bytes_down"] * down_rate / 1e9 + s["billed_bytes_up"] * up_rate / 1e9
            + s["requests_a"] * 0.005 / 1000 + s["requests_b"] * 0.0004 / 1000)


def test_a_real_run_across_two_clouds_bills_each_worker(in_process, tmp_path, monkeypatch) -> None:
    """Store in aws:us-east-1, region-a beside it, region-b in GCP: region-b pays the
    internet rates both ways, region-a only its requests; the status, its JSON and
    the train flow's report all say so."""
    from rich.console import Console

    from cli.app import app
    from cli.figures import print_report
    from flows.launchers import LocalLauncher
    from flows.train import run_train
    from workers.config import load_config
    from workers.data.prepare import prepare_data
    from workers.report import markdown

    monkeypatch.setenv("DILOCO_TRACKING", "off")
    data = str(tmp_path / "data")
    prepare_data(["builtin:shakespeare/tragedies/*"], data, max_bytes=100_000)
    cfg = load_config("tiny", [
        "model.overrides={d_model: 64, n_layers: 2, n_heads: 2, max_seq_len: 64}",
        "data.seq_len=32", "data.batch_size=8", "train.steps=16", "train.eval_every=0",
        "train.eval_batches=2", "train.threads=1", "sync.schedule.sync_every=8", "sync.schedule.fragments=2",
        "train.checkpoint_every=8", f"data.dataset={data}", f"store={tmp_path / 'runs'}",
        "billing.store=aws:us-east-1",
        "billing.regions={region-a: aws:us-east-1, region-b: gcp:europe-west4}"])
    url = str(tmp_path / "runs" / "billed")
    report = run_train(cfg, url, launcher=LocalLauncher(), poll_s=0.3)
    assert report["state"] == "finished", report

    result = in_process.invoke(app, ["status", url, "--json"])
    assert result.exit_code == 0, result.output
    status = __import__("json").loads(result.stdout)
    a, b = status["workers"]["region-a"], status["workers"]["region-b"]
    assert b["crossing"] == "internet" and a["crossing"] == "none"
    assert b["billed_bytes_up"] > b["bytes_up"] > 0  # its checkpoints are billed too
    assert b["cost_usd"] == pytest.approx(_by_hand(b, up_rate=0.12, down_rate=0.09))
    assert b["egress_usd"] > 0.0
    assert a["egress_usd"] == 0.0 and a["cost_usd"] > 0  # requests only
    assert a["cost_usd"] == pytest.approx(_by_hand(a, up_rate=0, down_rate=0))
    cost = status["cost"]
    assert cost["parties"]["region-b"]["cost_usd"] == b["cost_usd"]
    assert cost["total_usd"] == pytest.approx(
        a["cost_usd"] + b["cost_usd"] + status["aggregator"]["cost_usd"])
    assert cost["prices"]["aws"]["read"] == DEFAULT_PRICES["aws"].read

    shown = in_process.invoke(app, ["status", url])
    text = " ".join(shown.stdout.split())
    assert "cost: $" in text and "region-b internet" in text
    assert f"aws list prices read {DEFAULT_PRICES['aws'].read}" in text

    g = report["global"]
    rows = {w["worker"]: w for w in report["workers"]}
    assert rows["region-b"]["cost_usd"] == pytest.approx(b["cost_usd"])
    assert g["cost_usd"] == pytest.approx(g["workers_cost_usd"] + g["aggregator_cost_usd"])
    assert f"aws read {DEFAULT_PRICES['aws'].read}" in markdown(report)
    console = Console(record=True, width=200)
    print_report(console, report)
    assert "cost: $" in console.export_text()


def test_mlflow_gets_the_cost_per_round_per_worker_and_on_the_parent() -> None:
    from tracking.metrics import cost_totals, numbers, round_metrics, round_size

    report = {"fragment": 0, "round": 1, "weights": {"a": 1.0}, "cost_usd": 0.5,
              "egress_usd": 0.4, "requests_usd": 0.1, "crossing": "internet"}
    schedule = {"fragments": 2, "sync_every": 8}
    names = {m.key: m.value for m in round_metrics(report, schedule, 0, 3)}
    assert names["cost_usd"] == 0.5 and names["egress_usd"] == 0.4
    assert len(names) == round_size(report)
    worker = {m.key for m in numbers({"step": 1, "cost_usd": 0.2, "crossing": "none"}, 0, 1,
                                     skip=("step",))}
    assert worker == {"cost_usd"}  # the crossing is a word, not a metric
    summary = {"global": {"cost_usd": 1.5, "workers_cost_usd": 1.0,
                          "aggregator_cost_usd": 0.5, "egress_usd": 1.2, "requests_usd": 0.3}}
    assert cost_totals(summary) == summary["global"]
    assert cost_totals({}) == {}


def test_a_run_with_no_prices_says_how_to_price_it():
    from workers.report import cost_line  # noqa: PLC0415

    cost = {"total_usd": 0.0, "workers_usd": 0.0, "aggregator_usd": 0.0, "egress_usd": 0.0,
            "requests_usd": 0.0, "store": "other:local", "parties": {"w0": {"crossing": "none"}},
            "prices": {"other": {"read": "-", "source": "on-premises"}}}
    text = " ".join(cost_line(cost))
    assert "not priced" in text and "billing.store" in text
    cost["prices"] = {"aws": {"read": "2026-11-25", "source": "x"},
                      "other": {"read": "-", "source": "y"}}
    text = " ".join(cost_line(cost))
    assert "aws list prices read 2026-11-25" in text and "other list prices" not in text


def test_byte_amounts_read_in_decimal_units_and_an_unknown_one_keeps_its_column():
    assert human_bytes(999) == "999 B"
    assert human_bytes(1_000) == "1.0 kB"
    assert human_bytes(12_345_678) == "12.3 MB"
    assert human_bytes(12_345_678, 2) == "12.35 MB"
    assert human_bytes(-2.5e9) == "-2.5 GB"  # a saving reads as one
    assert human_bytes(3.2e15) == "3,200.0 TB"
    assert human_bytes(None) == human_bytes(float("nan")) == "-"
