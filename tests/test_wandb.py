"""``--wandb PROJECT``: the offline/online choice, the clear error without the package, and,
where wandb is installed (the ``[wandb]`` extra), a real offline run that logs the records."""

import pytest

from shardwise.report.wandb_log import wandb_mode


def test_offline_unless_the_user_configured_wandb(tmp_path):
    nonetrc = tmp_path / "none"
    assert wandb_mode({}, nonetrc) == "offline"
    assert wandb_mode({"WANDB_MODE": "disabled"}, nonetrc) == "disabled"
    assert wandb_mode({"WANDB_API_KEY": "k"}, nonetrc) == "online"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password k\n")
    assert wandb_mode({}, netrc) == "online"
    assert wandb_mode({"WANDB_MODE": "offline"}, netrc) == "offline"


def test_wandb_flag_without_the_package_names_the_extra(monkeypatch):
    import builtins

    from shardwise.errors import ShardwiseConfigError
    from shardwise.report.wandb_log import require_wandb

    real = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ShardwiseConfigError, match=r"\.\[wandb\]"):
        require_wandb()


def test_metrics_logger_mirrors_records_to_an_offline_wandb_run(tmp_path, monkeypatch, capsys):
    import wandb  # in the dev extra: `make test` runs this test for real
    from shardwise.train.metrics import MetricsLogger, read_metrics

    for k in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    m = MetricsLogger(tmp_path, enabled=True, tensorboard=False, wandb="shardwise-test",
                      run_config={"dp": 2})
    assert m._wandb.mode == "offline"
    recs = [{"step": 0, "val_loss": 4.5}] + [
        {"step": s, "loss": 4.0 - s / 10, "comm_bytes": 30.0, "comm_dp_bytes": 10.0,
         "comm_tp_bytes": 20.0, "moe_tokens_per_expert": [1, 2]} for s in (1, 2, 3)]
    run, sent = m._wandb.run, []
    real_log = run.log

    def spy(data, step=None, **kw):  # what reaches wandb, passed on to the real run
        sent.append((step, dict(data)))
        return real_log(data, step=step, **kw)

    monkeypatch.setattr(run, "log", spy)
    for r in recs:
        m.log(r)
    want = [(r["step"], {k: v for k, v in r.items() if k not in ("step",
                                                                  "moe_tokens_per_expert")})
            for r in recs]  # the same fields as metrics.jsonl, lists left out
    assert sent == want
    assert dict(run.summary)["comm_tp_bytes"] == 20.0  # the real run took them
    m.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == recs
    offline = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb")), "no offline run file"
    assert wandb.run is None  # finished
    # where the offline run went, and how to upload it, printed once (at the start: a crashed
    # run's records are there too; it used to be printed again at the end, issue 51)
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("wandb:")]
    assert len(said) == 1 and all(f"offline run in {offline[0]}" in ln and f"wandb sync {offline[0]}"
                        in ln for ln in said), said
