"""The report as data, JSON, table and Prometheus text; the CLI's flag checks; import hygiene."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from diag.agent.node.linkstate import NicState
from diag.agent.precheck.classify import Observations, classify
from diag.agent.precheck.grading import Thresholds
from diag.agent.precheck.measurements import ComputeResult, LocalEvidence, PairResult, Severity
from diag.agent.precheck.precheckconfig import LocalCheck, Measure, PrecheckSettings
from diag.agent.precheck.promfile import FAMILIES, registry_for, write_textfile
from diag.agent.precheck.report import Outcome, PrecheckReport, build_report, error_report
from diag.agent.precheck.table import render
from diag.cli import precheckcmd
from diag.cli.main import main
from diag.formats import exitcodes

TH = Thresholds()


def _report(bad_link: bool = True) -> PrecheckReport:
    slow = 11.9e6 if bad_link else 790e6
    pairs = (
        PairResult(1, 0, 1, 800e6),
        PairResult(1, 2, 3, slow),
        PairResult(2, 1, 2, 790e6),
        PairResult(2, 3, 0, slow),
    )
    local = {
        n: LocalEvidence(
            node=n,
            host=f"host-{n}",
            compute=(ComputeResult("cpu", 46e9, 512, "float32"),),
            nic=NicState("eth0", f"10.0.0.{n + 1}", "up", True, 10000),
            notes=("no GPU: intra-node device copies skipped",),
        )
        for n in range(4)
    }
    obs = Observations(4, frozenset(range(4)), local=local, pairs=pairs, rdzv_timeout_s=30)
    return build_report(
        job="llama",
        obs=obs,
        assessment=classify(obs, TH),
        th=TH,
        rounds=[[(0, 1), (2, 3)], [(1, 2), (3, 0)]],
        addrs={n: f"10.0.0.{n + 1}" for n in range(4)},
        reported_by=2,
        started_at=1_700_000_000.0,
        wall_seconds=4.2,
        settings={"straggler_ratio": 0.5},
    )


def test_report_names_the_straggler_with_numbers():
    r = _report()
    assert r.outcome is Outcome.FAULTY and r.exit_code == exitcodes.PRECHECK_FAULTY
    assert (r.faulty, r.stragglers, r.suspects) == ((), (3,), ())
    node = r.node(3)
    assert node is not None and node.status is Severity.STRAGGLER
    assert node.busbw_bytes_per_s == pytest.approx(11.9e6)
    assert node.median_busbw_bytes_per_s == pytest.approx(795e6)
    assert "11.9 MB/s" in node.reason and "median 795 MB/s" in node.reason
    assert [(x.peer, x.grade) for x in node.links] == [(2, "slow"), (0, "slow")]


def test_healthy_report_exit_code():
    r = _report(bad_link=False)
    assert r.outcome is Outcome.HEALTHY and r.exit_code == exitcodes.OK
    assert (r.faulty, r.stragglers, r.suspects) == ((), (), ())


def test_json_round_trip():
    r = _report()
    text = json.dumps(r.to_dict())
    back = PrecheckReport.from_dict(json.loads(text))
    assert back == r
    d = json.loads(text)
    assert d["stragglers"] == [3] and d["faulty"] == []
    assert d["nodes"][3]["status"] == "straggler"
    assert d["nodes"][3]["findings"][0]["check"] == "inter"


def test_json_version_is_checked():
    d = _report().to_dict()
    d["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        PrecheckReport.from_dict(d)


def test_table():
    text = render(_report())
    lines = text.splitlines()
    assert lines[0].startswith("diag precheck: 4 nodes, 2 rounds, 4.2 s: stragglers [3]")
    row3 = next(line for line in lines if line.startswith("3 "))
    assert "straggler" in row3 and "11.9 MB/s" in row3 and "host-3" in row3
    assert any(line.startswith("2*") for line in lines)  # this node
    assert any(line.startswith("median") and "795 MB/s" in line for line in lines)
    # a note shared by every node is printed once
    assert sum("intra-node device copies skipped" in line for line in lines) == 1


def test_error_report_names_self_only_on_own_evidence():
    common = dict(job="j", nnodes=4, node=2, started_at=0.0, wall_seconds=1.0, settings={}, th=TH)
    down = LocalEvidence(2, nic=NicState("eth0", None, "lowerlayerdown", False))
    r = error_report(error="could not reach the rendezvous", local=down, **common)
    assert r.outcome is Outcome.FAULTY and r.faulty == (2,)
    up = LocalEvidence(2, nic=NicState("eth0", "10.0.0.3", "up", True))
    r = error_report(error="could not reach the rendezvous", local=up, **common)
    assert r.outcome is Outcome.ERROR and r.exit_code == exitcodes.PRECHECK_ERROR
    assert r.faulty == () and r.error == "could not reach the rendezvous"


def test_metrics_text(tmp_path):
    r = _report()
    path = tmp_path / "precheck.prom"
    write_textfile(r, path)
    text = path.read_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for fam in FAMILIES:
        assert fam.name in families, fam.name
        assert families[fam.name].documentation == fam.help
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    key = ("diag_precheck_node_status", (("job", "llama"), ("node", "3"), ("status", "straggler")))
    assert samples[key] == 1
    key = ("diag_precheck_busbw_bytes_per_second", (("job", "llama"), ("node", "3")))
    assert samples[key] == pytest.approx(11.9e6)
    assert samples[("diag_precheck_exit_code", (("job", "llama"),))] == 4
    key = ("diag_precheck_nodes", (("job", "llama"), ("status", "straggler")))
    assert samples[key] == 1
    link = (
        "diag_precheck_link_busbw_bytes_per_second",
        (("job", "llama"), ("node", "3"), ("peer", "2")),
    )
    assert samples[link] == pytest.approx(11.9e6)
    for s in (s for f in families.values() for s in f.samples):
        assert s.labels["job"] == "llama"
    assert registry_for(r).get_sample_value("diag_precheck_rounds", {"job": "llama"}) == 2


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_metrics_pass_promtool_lint(tmp_path):
    path = tmp_path / "precheck.prom"
    write_textfile(_report(), path)
    out = subprocess.run(
        ["promtool", "check", "metrics"], input=path.read_bytes(), capture_output=True, timeout=30
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    ("argv", "env", "words"),
    [
        ([], {}, "master-addr is not set"),
        (["--master-addr", "h"], {}, "master-port is not set"),
        (["--master-addr", "h", "--master-port", "1"], {"NNODES": "1:4"}, "is a range"),
        (
            ["--master-addr", "h", "--master-port", "1", "--nnodes", "2", "--node-rank", "2"],
            {},
            "outside 0..1",
        ),
        (
            ["--nnodes", "2", "--node-rank", "0", "--min-busbw", "fast"],
            {"MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "bad rate",
        ),
        (
            ["--nnodes", "2", "--node-rank", "0", "--straggler-ratio", "2"],
            {"MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "(0, 1]",
        ),
        (
            ["--nnodes", "2", "--node-rank", "0", "--checks", "inter,disk"],
            {"MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "disk",
        ),
        (
            ["--nnodes", "2", "--node-rank", "0", "--iface", "nosuch0"],
            {"MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "no interface 'nosuch0'",
        ),
        (
            ["--nnodes", "2", "--node-rank", "0", "--collective-timeout", "0"],
            {"MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "--collective-timeout: must be > 0",
        ),
        (
            ["--nnodes", "2", "--node-rank", "0"],
            {"MASTER_ADDR": "h", "MASTER_PORT": "1", "DIAG_PRECHECK_PAIR_SECONDS": "nan"},
            "DIAG_PRECHECK_PAIR_SECONDS: expected a finite number",
        ),
        (
            ["--nnodes", "2", "--node-rank", "0", "--heartbeat", "6"],
            {"MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "--lost-after 10 must be at least twice --heartbeat 6",
        ),
        (
            ["--nnodes", "2", "--node-rank", "0", "--matmul-size", "8"],
            {"MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "'8' is out of range (given as a flag; allowed: [16, 65536])",
        ),
    ],
)
def test_cli_usage_errors(argv, env, words, monkeypatch, capsys):
    for var in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["precheck", *argv]) == exitcodes.USAGE
    err = capsys.readouterr().err
    assert err.startswith("diag precheck: error: ") and words in err
    assert "Traceback" not in err


def test_pure_modules_do_not_import_torch():
    modules = [
        "diag.cli.precheckcmd",
        "diag.agent.precheck.report",
        "diag.agent.precheck.classify",
        "diag.agent.precheck.rounds",
        "diag.agent.precheck.promfile",
        "diag.agent.precheck.table",
        "diag.agent.precheck.session",
        "diag.agent.precheck.coordinator",
    ]
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules)
    code += "assert 'torch' not in sys.modules, 'torch was imported'\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _settings(argv: list[str], env: dict[str, str]) -> PrecheckSettings:
    parser = argparse.ArgumentParser()
    precheckcmd.add_arguments(parser)
    return precheckcmd.build_config(
        parser.parse_args(argv), {"MASTER_ADDR": "h", "MASTER_PORT": "1", **env}
    )


def test_options_come_from_flag_then_environment_then_config_file(tmp_path):
    config = tmp_path / "diag.toml"
    config.write_text(
        "[agent]\nhang_timeout = 60\n\n"
        '[precheck]\npair_seconds = 3\nmax_rounds = 2\ncopy_size = "1GiB"\n'
        'checks = ["inter", "compute"]\ndevice_pairs = "0-1,2-3"\nmin_busbw = "10Gbit"\n'
    )
    base = ["--nnodes", "2", "--node-rank", "1", "--config", str(config)]
    cfg = _settings(base, {})
    m = cfg.measure
    assert (m.pair_seconds, cfg.max_rounds, m.copy_bytes) == (3.0, 2, 1 << 30)
    assert m.checks == {LocalCheck.INTER, LocalCheck.COMPUTE}
    assert m.device_pairs.resolve(4) == [(0, 1), (2, 3)]
    assert cfg.thresholds.min_busbw == 10e9 / 8
    env = {"DIAG_PRECHECK_PAIR_SECONDS": "5", "DIAG_PRECHECK_MAX_ROUNDS": "4"}
    cfg = _settings(base, env)
    assert (cfg.measure.pair_seconds, cfg.max_rounds) == (5.0, 4)
    cfg = _settings([*base, "--pair-seconds", "7"], env)
    assert (cfg.measure.pair_seconds, cfg.max_rounds) == (7.0, 4)
    # Nothing given: the defaults the docs list.
    cfg = _settings(["--nnodes", "2", "--node-rank", "1"], {})
    assert cfg.measure == Measure() and cfg.thresholds == Thresholds() and cfg.max_rounds == 5


def test_a_config_file_with_an_unknown_precheck_key_is_refused(tmp_path, capsys):
    config = tmp_path / "diag.toml"
    config.write_text("[precheck]\npair_second = 3\n")
    argv = ["--master-addr", "h", "--master-port", "1", "--nnodes", "2", "--node-rank", "0"]
    assert main(["precheck", *argv, "--config", str(config)]) == exitcodes.USAGE
    err = capsys.readouterr().err
    assert "unknown option 'pair_second' in [precheck]" in err and "Traceback" not in err
