"""Run tracking: W&B offline/resume/fallback read back from W&B's own files, no leaked
secrets, MFU arithmetic, and the run-comparison script. Nothing here reaches a network."""

import importlib
import importlib.util
import json
import os
import re
import struct
import sys
import tempfile

import matplotlib
import ml_collections
import numpy as np
import pytest
from conftest import BATCH_SIZE, tiny_cpu_config

matplotlib.use("Agg")
from matplotlib import image as mpl_image  # noqa: E402

from model import ModelConfig  # noqa: E402
import parallelism  # noqa: E402
from trainer.config import flops
from trainer.track import provenance, tracking, wandb_tracker  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_KEY = "f4k3" * 10  # 40 characters, like a real W&B API key.
FAKE_TOKEN = "planted-secret-token-value-1234"
TRAIN_KEYS = ("loss", "grad_norm", "lr", "tokens_per_sec", "tokens_per_sec_per_device",
              "step_time_s", "warmup")


def _plant_secrets(monkeypatch):
  monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
  monkeypatch.setenv("MY_SECRET_TOKEN", FAKE_TOKEN)


def _assert_no_secret(workdir, *texts):
  for text in texts:
    assert FAKE_KEY not in text and FAKE_TOKEN not in text
  for folder, _, files in os.walk(workdir):
    for name in files:
      path = os.path.join(folder, name)
      if os.path.islink(path):
        continue
      with open(path, "rb") as f:
        content = f.read()
      for secret in (FAKE_KEY, FAKE_TOKEN):
        assert secret.encode() not in content, (secret, path)


def _wandb_records(workdir):
  """Every record of every `.wandb` file under `<workdir>/wandb`, in run-start order.

  The file is a LevelDB-style log (W&B's own format): a 7-byte header (':W&B', magic, version),
  then 32 KiB blocks of chunks, each with a 7-byte header (CRC, length, type: full, first,
  middle, last) and a piece of a serialised `Record` protobuf.
  """
  import wandb  # pylint: disable=g-import-not-at-top
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top

  wandb.teardown()  # `finish` may return before W&B's service has flushed the file; this waits.
  wandb_dir = os.path.join(workdir, "wandb")
  runs = sorted(d for d in os.listdir(wandb_dir) if d.startswith(("run-", "offline-run-"))
                and not os.path.islink(os.path.join(wandb_dir, d)))

  def start(run_dir):  # run-<time>-<id>, or run-<time>-<id>-<n> when <time> was taken.
    match = re.search(r"-(\d{8}_\d{6})-[a-z0-9]+(?:-(\d+))?$", run_dir)
    return match.group(1), int(match.group(2) or 0)

  out = []
  for run_dir in sorted(runs, key=start):
    (name,) = [n for n in os.listdir(os.path.join(wandb_dir, run_dir)) if n.endswith(".wandb")]
    with open(os.path.join(wandb_dir, run_dir, name), "rb") as f:
      data = f.read()
    assert data[:4] == b":W&B"
    pos, chunks = 7, []
    while pos + 7 <= len(data):
      if 32768 - pos % 32768 < 7:
        pos += 32768 - pos % 32768  # Block trailer too short for a header: padding.
        continue
      _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
      if kind == 0 and length == 0:
        break
      chunks.append(data[pos + 7:pos + 7 + length])
      pos += 7 + length
      if kind in (1, 4):  # Full, or last of a split record.
        record = wandb_internal_pb2.Record()
        record.ParseFromString(b"".join(chunks))
        chunks = []
        out.append((run_dir, record))
  return out


def _history(workdir):
  """[(run_dir, step, {key: value})] from the W&B files, in order."""
  rows = []
  for run_dir, record in _wandb_records(workdir):
    if record.WhichOneof("record_type") == "history":
      items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
               for item in record.history.item}
      rows.append((run_dir, record.history.step.num, items))
  return rows


def _run_records(workdir):
  return [r.run for _, r in _wandb_records(workdir) if r.WhichOneof("record_type") == "run"]


def _config(**overrides):
  config = importlib.import_module("configs.tiny_cpu").get_config()
  for path, value in overrides.items():
    group, key = path.split(".")
    config[group][key] = value
  return config


def _record(step, loss=1.0, warmup=False):
  return {"step": step, "loss": loss, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_sec": 1000.0,
          "tokens_per_sec_per_device": 125.0, "step_time_s": 2.048, "mfu": None,
          "attention": "dense", "warmup": warmup}


# --- Units: no training, a second or two each. ---------------------------------------------


def test_mode_resolution_env_wins_and_auto_needs_a_key(tmp_path):
  no_netrc = {"NETRC": str(tmp_path / "absent")}
  assert wandb_tracker.resolve_mode("auto", no_netrc) == "offline"
  assert wandb_tracker.resolve_mode("auto", {**no_netrc, "WANDB_API_KEY": FAKE_KEY}) == "online"
  assert wandb_tracker.resolve_mode("online", {"WANDB_MODE": "disabled"}) == "disabled"
  assert wandb_tracker.resolve_mode("offline", {"WANDB_MODE": "online"}) == "online"
  assert wandb_tracker.resolve_mode("disabled", {}) == "disabled"
  (tmp_path / "netrc").write_text(f"machine api.wandb.ai login user password {FAKE_KEY}\n")
  assert wandb_tracker.resolve_mode("auto", {"NETRC": str(tmp_path / "netrc")}) == "online"
  with pytest.raises(ValueError, match="not one of"):
    wandb_tracker.resolve_mode("sometimes", {})


def test_names_group_by_model_and_length_and_tag_the_layout():
  config = _config(**{"wandb.tags": "sweep1, ring"})
  config.model.attention = "ring"
  assert wandb_tracker.run_names(config) == ("d128x2L-256-ring", "d128x2L-256",
                                             ["ring", "sweep1"])
  config.model.sequence_parallel = "hybrid"
  assert wandb_tracker.run_names(config) == ("d128x2L-256-ring-hybrid", "d128x2L-256",
                                             ["ring", "hybrid", "sweep1"])


def test_the_resolved_record_fills_the_mesh_and_names_the_auto_kernel():
  config = _config()
  config.model.attention = "striped"
  config.mesh.data, config.mesh.fsdp, config.mesh.sequence, config.mesh.tensor = 1, -1, 4, 1
  resolved = provenance.run_resolved(config)
  assert resolved["mesh"] == {"data": 1, "fsdp": 2, "sequence": 4, "ulysses": 1, "tensor": 1}
  assert (config.model.kernel, resolved["attention_kernel"], resolved["backend"]) == (
      "auto", "xla", "cpu")
  assert [parallelism.resolve_kernel("auto", backend) for backend in ("gpu", "tpu", "cpu")] == [
      "cudnn", "splash", "xla"]
  assert parallelism.resolve_kernel("pallas", "cpu") == "pallas"  # A named kernel is kept.


def test_scrub_redacts_secret_fields_and_values_but_keeps_tokenizer():
  value = {"api_key": "abc", "data": {"tokenizer": "sp.model", "max_document_tokens": 7},
           "note": f"x{FAKE_TOKEN}y", "rules": (("embed", "fsdp"),)}
  scrubbed = tracking.scrub(value, [FAKE_TOKEN])
  assert scrubbed == {"api_key": "<redacted>",
                      "data": {"tokenizer": "sp.model", "max_document_tokens": 7},
                      "note": "x<redacted>y", "rules": (("embed", "fsdp"),)}


def test_every_tool_records_its_command_line_scrubbed(monkeypatch):
  """The trainer's provenance and eval_needle's result file share one scrubber: a secret
  flag's value (either form) and a secret environment value never reach the workdir."""
  monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
  argv = ["scripts/eval_needle.py", "--workdir=runs/a", f"--config.wandb.project={FAKE_TOKEN}",
          "--config.wandb.api_key=abc123", "--auth_token", "xyz789", "--lengths", "64"]
  spec = importlib.util.spec_from_file_location(
      "eval_needle", os.path.join(ROOT, "scripts", "eval_needle.py"))
  eval_needle = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(eval_needle)
  record = eval_needle.result_record(3, [64], [0.0], 1, [{"a_value": True}], np.ones((1, 1)),
                                     1.0, argv)
  expected = ("scripts/eval_needle.py --workdir=runs/a '--config.wandb.project=<redacted>' "
              "'--config.wandb.api_key=<redacted>' --auth_token '<redacted>' --lengths 64")
  assert record["command"] == provenance.run_provenance(argv)["command"] == expected


def test_wandb_offline_tracker_resumes_the_same_run_without_going_back(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  _plant_secrets(monkeypatch)
  config = _config(**{"wandb.name": FAKE_TOKEN})  # A secret in the config is redacted too.
  config.wandb.workspace = str(tmp_path / "workspace")
  tracker = wandb_tracker.make(config, str(tmp_path))
  for step in (1, 2, 3):
    tracker.log(_record(step, warmup=step == 1))
  tracker.log({"step": 3, "eval_loss": 2.5})
  tracker.close()
  # A crash after step 3 and a checkpoint at step 2: the resumed process replays step 3.
  tracker = wandb_tracker.make(config, str(tmp_path))
  for step in (3, 4):
    tracker.log(_record(step))
  tracker.close()
  rows = _history(tmp_path)
  assert [step for _, step, _ in rows] == [1, 2, 3, 4]
  assert rows[2][2]["eval_loss"] == 2.5 and rows[2][2]["loss"] == 1.0
  assert len({run_dir for run_dir, _, _ in rows}) == 2  # One folder per process...
  ids = {run.run_id for run in _run_records(tmp_path)}
  assert len(ids) == 1  # ...one W&B run.
  assert json.loads((tmp_path / "wandb" / "run.json").read_text()) == {
      "id": ids.pop(), "last_step": 4}
  # Another workdir, same workspace: a W&B run of its own, linked beside the first.
  other = wandb_tracker.make(config, str(tmp_path / "other"))
  other.log(_record(1))
  other.close()
  links = sorted((tmp_path / "workspace").iterdir())
  folders = [*(tmp_path / "wandb").glob("offline-run-*"),
             *(tmp_path / "other" / "wandb").glob("offline-run-*")]
  assert sorted(link.resolve() for link in links) == sorted(f.resolve() for f in folders)
  assert len({json.loads((workdir / "wandb" / "run.json").read_text())["id"]
              for workdir in (tmp_path, tmp_path / "other")}) == 2  # Two runs, two ids.
  _assert_no_secret(tmp_path)


def test_wandb_disabled_builds_no_run(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "disabled")
  assert isinstance(wandb_tracker.make(_config(), str(tmp_path)), tracking.NoopTracker)
  assert not (tmp_path / "wandb").exists()


def test_console_lines_show_step_loss_speed_and_eta(capsys):
  console = tracking.ConsoleTracker(10, bar=False)
  console.log(_record(5))
  console.log({"step": 5, "eval_loss": 1.25})
  out = capsys.readouterr().out.splitlines()
  assert out[0].split() == ["step", "5/10", "loss", "1.0000", "grad_norm", "0.500", "1,000",
                            "tok/s", "ETA", "0:00:10"]
  assert out[1] == "eval at step 5: eval_loss 1.2500"
  console.log(_record(1, warmup=True))  # Its time is mostly the compile: no ETA from it.
  assert capsys.readouterr().out.split()[-3:] == ["warm-up", "ETA", "?"]


def test_jsonl_tracker_scrubs_secret_values(tmp_path, monkeypatch):
  _plant_secrets(monkeypatch)
  tracker = tracking.JsonlTracker(str(tmp_path / "metrics.jsonl"))
  tracker.log({"step": 1, "note": f"token={FAKE_TOKEN}"})
  tracker.close()
  _assert_no_secret(tmp_path)


def test_flops_and_mfu_match_a_hand_computation():
  config = _config()
  cfg = ModelConfig(**config.model.to_dict())
  # tiny_cpu: L=2, d=128, Hq=4, Hkv=2, D=128/4=32, d_ff=344, V=512, S=256.
  # Per layer: attention projections 128*32*(2*4 + 2*2) = 49,152; SwiGLU 3*128*344 = 132,096.
  # N_matmul = 2 * (49,152 + 132,096) + 128*512 (output projection) = 428,032.
  # Attention (causal, fwd+bwd) = 6 * L * Hq * D * S = 6*2*4*32*256 = 393,216.
  # FLOPs/token = 6 * 428,032 + 393,216 = 2,961,408.
  assert flops.flops_per_token(cfg, 256) == 2_961_408
  # A step of 8 rows x 256 tokens in 0.5 s on 8 devices of 1 TFLOP/s peak each:
  # 2,048 / 0.5 = 4,096 tokens/s; MFU = 2,961,408 * 4,096 / (8 * 1e12) = 0.001516240896.
  tokens_per_sec = config.train.batch_size * config.data.seq_len / 0.5
  assert tokens_per_sec == 4096
  assert flops.mfu(2_961_408, tokens_per_sec, 8, 1e12) == pytest.approx(0.001516240896,
                                                                       rel=1e-12)
  # H100: 2,961,408 * 4,096 / (8 * 989e12).
  assert flops.mfu(2_961_408, 4096, 8, flops.peak_flops(_config(), "NVIDIA H100 80GB HBM3")) \
      == pytest.approx(12_129_927_168 / (8 * 989e12))


def test_flops_of_local_layers_count_their_window_and_sinks():
  """Each query of a window-w layer sees min(i + 1, w) keys, and with k sinks up to k more
  beyond the window: counted by hand over a row of 10 tokens, w = 4, k = 2."""
  fields = dict(num_layers=1, d_model=8, num_heads=2, num_kv_heads=2, d_ff=8, vocab_size=16,
                window=4, layer_pattern="L")
  seen = [min(i + 1, 4) for i in range(10)]  # 1, 2, 3, 4, 4, ... 4: 34 keys
  sinks = [min(2, max(i - 3, 0)) for i in range(10)]  # 0, 0, 0, 0, 1, 2, ... 2: 11 keys
  attention = 12 * 2 * 4  # 12 * Hq * D per key a query sees
  for count, keys in ((0, sum(seen)), (2, sum(seen) + sum(sinks))):
    cfg = ModelConfig(**fields, sink_tokens=count)
    assert flops.flops_per_token(cfg, 10) == pytest.approx(
        6 * cfg.matmul_params() + attention * keys / 10, rel=1e-12)


def test_peak_flops_from_number_name_or_device_kind():
  config = ml_collections.ConfigDict({"accelerator": "", "peak_flops_per_device": 0.0})
  assert flops.peak_flops(config, "cpu") is None
  for kind, name in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                     ("NVIDIA A100-SXM4-40GB", "a100"), ("TPU v4", "tpu_v4"),
                     ("TPU v5 lite", "tpu_v5e"), ("TPU v5", "tpu_v5p")):
    assert flops.peak_flops(config, kind) == flops.PEAK_FLOPS[name], kind
  config.accelerator = "tpu_v5p"
  assert flops.peak_flops(config, "cpu") == 459e12
  config.peak_flops_per_device = 123e12  # A number beats the table.
  assert flops.peak_flops(config, "NVIDIA H100 80GB HBM3") == 123e12
  config.peak_flops_per_device, config.accelerator = 0.0, "h1000"
  with pytest.raises(ValueError, match="h1000"):
    flops.peak_flops(config, "cpu")


def test_device_memory_is_none_on_cpu():
  assert tracking.device_memory_bytes() is None


def test_unreachable_server_falls_back_to_offline_with_one_warning(tmp_path, monkeypatch,
                                                                    capfd):
  _plant_secrets(monkeypatch)
  monkeypatch.setenv("WANDB_MODE", "online")
  monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # Nothing listens on port 9.
  monkeypatch.setenv("WANDB_INIT_TIMEOUT", "2")
  tracker = wandb_tracker.make(_config(), str(tmp_path))
  tracker.log(_record(1))
  tracker.close()
  out, err = capfd.readouterr()
  warnings = [line for line in (out + err).splitlines() if "falling back to offline" in line]
  assert len(warnings) == 1 and warnings[0].startswith("warning: W&B"), out + err
  assert [step for _, step, _ in _history(tmp_path)] == [1]
  _assert_no_secret(tmp_path, out, err)


# --- End to end: tiny training runs (need the data package). -------------------------------


class _CaptureFds:
  """Captures what this process (sys.stdout/err and fds 1, 2) and its children (W&B's
  service) print, like pytest's capfd but usable in a module-scoped fixture."""

  def __enter__(self):
    self._file = tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    self._saved = [os.dup(1), os.dup(2)]
    os.dup2(self._file.fileno(), 1)
    os.dup2(self._file.fileno(), 2)
    self._streams = sys.stdout, sys.stderr
    self._text = open(self._file.fileno(), "w", buffering=1, closefd=False)
    sys.stdout = sys.stderr = self._text
    return self

  def __exit__(self, *exc):
    self._text.flush()
    sys.stdout, sys.stderr = self._streams
    for fd, saved in zip((1, 2), self._saved):
      os.dup2(saved, fd)
      os.close(saved)
    self._file.seek(0)
    self.text = self._file.read().decode(errors="replace")
    self._file.close()


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory, shared_data_dir):
  """A tiny dense run, secrets planted in its environment: 3 steps in W&B `online` mode
  against a server that is not there (so it falls back to offline), then resumed to 6 steps
  in `offline` mode, then run again with nothing to do. Returns (workdir, console output of
  the first part)."""
  from trainer.run.loop import train  # pylint: disable=g-import-not-at-top  # Needs `data`.

  workdir = tmp_path_factory.mktemp("runs") / "dense"
  config = tiny_cpu_config(shared_data_dir)  # The step other tests compile too.
  config.train.steps, config.train.log_every = 3, 1
  config.peak_flops_per_device = 1e12
  # A secret in a config field (unused by the synthetic corpus) must reach no file either:
  # config.json, the checkpoints' stored config, metrics, W&B.
  config.data.text_field = FAKE_TOKEN
  with pytest.MonkeyPatch.context() as monkeypatch:
    _plant_secrets(monkeypatch)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # Nothing listens on port 9.
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "2")
    with _CaptureFds() as console:
      summary = train(config, str(workdir))
    assert summary["steps"] == 3
    monkeypatch.setenv("WANDB_MODE", "offline")
    config.train.steps = 6
    train(config, str(workdir))
    train(config, str(workdir))  # Nothing to do: no third W&B run.
  return workdir, console.text


def test_online_run_with_an_unreachable_server_completes_offline(dense_run):
  workdir, console = dense_run
  warnings = [line for line in console.splitlines() if "falling back to offline" in line]
  assert len(warnings) == 1, console
  assert "done: step 3" in console
  runs = [d for d in os.listdir(workdir / "wandb") if d.startswith(("run-", "offline-run-"))]
  assert len(runs) == 2 and all(d.startswith("offline-run-") for d in runs), runs


def test_offline_history_holds_the_metrics_and_the_resumed_run_continues_it(dense_run):
  workdir, _ = dense_run
  rows = _history(workdir)
  assert [step for _, step, _ in rows] == [1, 2, 3, 4, 5, 6]
  for key in TRAIN_KEYS:
    assert all(key in items for _, _, items in rows), key
  assert len({run_dir for run_dir, _, _ in rows}) == 2  # Two processes...
  run_records = _run_records(workdir)
  assert len({run.run_id for run in run_records}) == 1  # ...one W&B run.
  config = {item.key: json.loads(item.value_json) for item in run_records[0].config.update}
  assert config["model"]["attention"] == "dense" and config["resolved"]["num_devices"] == 8
  assert set(config["provenance"]) == {"commit", "dirty", "command"}
  assert run_records[0].run_group == "d128x2L-256" and list(run_records[0].tags) == ["dense"]
  assert run_records[0].display_name == "d128x2L-256-dense"
  metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5, 6]
  assert [r["loss"] for r in metrics] == [items["loss"] for _, _, items in rows]


def test_logged_speed_and_mfu_agree_with_the_step_time(dense_run):
  workdir, _ = dense_run
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  flops_token = 2_961_408  # Hand-computed in test_flops_and_mfu_match_a_hand_computation.
  for r in records:
    assert r["tokens_per_sec"] * r["step_time_s"] == pytest.approx(BATCH_SIZE * 256)
    assert r["tokens_per_sec_per_device"] == pytest.approx(r["tokens_per_sec"] / 8)
    # config.peak_flops_per_device = 1e12 (the loop reads it through flops.peak_flops).
    assert r["mfu"] == pytest.approx(flops_token * r["tokens_per_sec"] / (8 * 1e12))
    assert r["device_memory_bytes"] is None  # The CPU reports no memory stats.


def test_no_secret_in_the_workdir_the_wandb_run_or_the_console(dense_run):
  workdir, console = dense_run
  _assert_no_secret(workdir, console)


def test_wandb_leet_reads_the_run_from_the_workspace_beside_the_workdir(dense_run, capfd,
                                                                      monkeypatch):
  """W&B's own reader (`wandb leet inspect --summary`, in-process) on the workspace's link."""
  import wandb  # pylint: disable=g-import-not-at-top
  from wandb.cli import leet  # pylint: disable=g-import-not-at-top

  workdir, _ = dense_run
  workspace = workdir.parent / "wandb"
  folders = sorted(d for d in os.listdir(workdir / "wandb") if d.startswith("offline-run-"))
  assert sorted(os.listdir(workspace)) == folders  # Both processes of the resumed run.
  monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")  # No telemetry upload from leet.
  wandb.teardown()  # The service has flushed every file.
  capfd.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    leet.leet.main(["inspect", "--summary", "--json", str(workspace / folders[-1])],
                   standalone_mode=False)
  out, err = capfd.readouterr()
  assert exit_info.value.code == 0, err
  run = json.loads(out)
  assert (run["state"], run["step"], run["tags"]) == ("finished", 6, ["dense"])
  assert run["summary"]["tokens_per_sec"] > 0 and run["summary"]["_step"] == 6
  assert run["config"]["model"]["attention"] == "dense"
  assert run["config"]["resolved"]["num_devices"] == 8 and "commit" in run["config"]["provenance"]
  _assert_no_secret(workdir.parent, out, err)  # The summary and every file of the runs.


@pytest.mark.slow
def test_compare_runs_prints_a_table_and_plots_both_runs(dense_run, tmp_path, capsys,
                                                         tiny_config, monkeypatch):
  from trainer.run.loop import train  # pylint: disable=g-import-not-at-top  # Needs `data`.

  monkeypatch.setenv("WANDB_MODE", "disabled")
  # Dense again, another seed: the fixture's compiled step serves it.
  other = tiny_config(None, **{"train.steps": 4, "train.log_every": 1})
  other.seed = 1
  train(other, str(tmp_path / "other"))
  spec = importlib.util.spec_from_file_location(
      "compare_runs", os.path.join(ROOT, "scripts", "compare_runs.py"))
  compare = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "compare_runs", compare)  # dataclasses look it up.
  spec.loader.exec_module(compare)
  capsys.readouterr()
  out_png = tmp_path / "not_yet" / "cmp.png"  # Its folder is made (was a PIL traceback).
  dirs = [str(dense_run[0]), str(tmp_path / "other")]
  assert compare.main(dirs + ["--out", str(out_png)]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].split()[:3] == ["run", "layout", "mesh"]
  dense_row, other_row = lines[2].split(), lines[3].split()
  assert dense_row[:4] == ["dense", "dense", "1x2x4x1x1", "256"] and dense_row[5] == "1.00x"
  assert other_row[:4] == ["other", "dense", "1x2x4x1x1", "256"]
  assert other_row[5].endswith("x") and np.isfinite(float(other_row[6]))
  with open(out_png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert mpl_image.imread(str(out_png)).ndim == 3  # Decodes as an RGB(A) image.
  layouts = [compare.Run("r", {"model": {"attention": "striped", "sequence_parallel": strategy}},
                         []).layout for strategy in ("ring", "allgather")]
  assert layouts == ["striped", "striped/allgather"]  # The strategy when it is not the ring.
  figure = compare.build_figure([compare.load_run(d) for d in dirs])
  speed_ax, loss_ax = figure.axes
  assert len(speed_ax.get_lines()) == 2 and len(loss_ax.get_lines()) == 2
  # The resumed run's steps appear once each; the first interval of each process is warm-up.
  assert list(loss_ax.get_lines()[0].get_xdata()) == [1, 2, 3, 4, 5, 6]
  assert list(speed_ax.get_lines()[0].get_xdata()) == [2, 3, 5, 6]
