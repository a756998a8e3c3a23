"""Weights & Biases tracking that never blocks or stops training, and never leaks a secret.

- Mode: an explicit `WANDB_MODE` environment variable wins over `config.wandb.mode`; `auto`
  is `online` when an API key is configured (WANDB_API_KEY, an identity token file, or a
  netrc entry for the W&B host) and `offline` otherwise; `disabled` builds no W&B run at all.
- An online run that cannot reach its server within `WANDB_INIT_TIMEOUT` seconds (default 30)
  falls back to offline with one warning line; `wandb sync` uploads it later.
- The run id and the last logged step live in `<workdir>/wandb/run.json`, so a run resumed in
  the same workdir continues the same W&B run; steps the resumed run repeats (those after
  its checkpoint and before the crash) are not logged again: W&B steps never go backwards.
- One workspace for the project: each run's files stay in its own `<workdir>/wandb` (deleting
  a workdir deletes its run), and a link to each process's run folder goes into the shared
  `config.wandb.workspace` (default: `wandb/` beside the workdirs), so `wandb leet runs/wandb`
  browses every run side by side, offline, and `wandb sync` can upload them from there.
- Secrets: the logged config, name, group and tags are scrubbed (`tracking.scrub`), and the
  settings below turn off what W&B would otherwise collect on its own: system metadata
  (command line, user, executable, environment-derived info), git state, code, requirements,
  console capture, system metrics, and crash reports to W&B's error service.
"""

from __future__ import annotations

import json
import netrc
import contextlib
import os
import secrets
import shutil
import string
from typing import Any
from urllib.parse import urlparse

import ml_collections

from model.config import named_strategy
from trainer.config.config_check import WANDB_MODES
from trainer.config.workdir import write_atomically
from trainer.track.provenance import run_records
from trainer.track.tracking import NoopTracker, Tracker, scrub, secret_values

_STATE_FILE = "run.json"


def resolve_mode(config_mode: str, environ: dict[str, str] | None = None) -> str:
  """online, offline or disabled, from WANDB_MODE (when set) or the config's mode."""
  environ = os.environ if environ is None else environ
  mode = (environ.get("WANDB_MODE", "").strip() or config_mode).lower()
  mode = {"dryrun": "offline", "run": "online"}.get(mode, mode)  # W&B's older spellings.
  if mode not in WANDB_MODES:
    raise ValueError(f"W&B mode {mode!r} (from WANDB_MODE or config.wandb.mode) is not one of "
                     f"{', '.join(WANDB_MODES)}")
  if mode == "auto":
    return "online" if has_api_key(environ) else "offline"
  return mode


def has_api_key(environ: dict[str, str] | None = None) -> bool:
  """Whether W&B credentials are configured, judged locally (no network)."""
  environ = os.environ if environ is None else environ
  if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
    return True
  host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
  try:
    return netrc.netrc(environ.get("NETRC") or None).authenticators(host or "") is not None
  except (OSError, netrc.NetrcParseError):
    return False


def default_group(config: ml_collections.ConfigDict) -> str:
  """Model width x depth and sequence length, e.g. 'd128x2L-256': ring and striped runs of
  the same model and length land in one group."""
  return f"d{config.model.d_model}x{config.model.num_layers}L-{config.data.seq_len}"


def run_names(config: ml_collections.ConfigDict) -> tuple[str, str, list[str]]:
  """(name, group, tags) of the run: the config's, or derived; the layout is always a tag,
  and so is a sequence-parallel strategy other than the default ring."""
  group = config.wandb.group or default_group(config)
  strategy = named_strategy(config.model.attention, config.model.sequence_parallel)
  attention = [config.model.attention] + ([strategy] if strategy else [])
  name = config.wandb.name or "-".join([group, *attention])
  tags = attention + [tag.strip() for tag in config.wandb.tags.split(",")
                      if tag.strip() and tag.strip() not in attention]
  return name, group, tags


class WandbTracker:
  """Logs each record at its training step; keeps `<workdir>/wandb/run.json` current."""

  def __init__(self, run, state_path: str, resumed_step: int):
    self._run, self._state_path = run, state_path
    self._floor = resumed_step  # Steps <= this were logged by an earlier process.
    self._last = resumed_step
    self._secrets = secret_values()
    self._failed = False

  def log(self, record: dict[str, Any]) -> None:
    step = int(record["step"])
    if self._failed or step <= self._floor or step < self._last:
      return
    values = {key: value for key, value in scrub(record, self._secrets).items()
              if key != "step" and value is not None}
    try:
      self._run.log(values, step=step)
    except Exception as error:  # pylint: disable=broad-except  # Never stop training.
      self._failed = True
      _warn(f"W&B logging failed ({_first_line(error)}); metrics.jsonl still has every step")
      return
    if step > self._last:
      self._last = step
      _save_state(self._state_path, self._run.id, step)

  def log_table_and_image(self, step: int, name: str, columns: list[str], rows: list[list],
                          image_path: str) -> None:
    """An evaluation's table and picture, at `step` or the run's last logged step if later
    (W&B drops values logged at a step it has passed)."""
    import wandb  # pylint: disable=g-import-not-at-top
    try:
      self._run.log({f"{name}/table": wandb.Table(columns=columns, data=rows),
                     f"{name}/heatmap": wandb.Image(image_path)}, step=max(step, self._last))
    except Exception as error:  # pylint: disable=broad-except
      _warn(f"W&B logging failed ({_first_line(error)}); the files on disk have it all")

  def close(self) -> None:
    try:
      self._run.finish()
    except Exception as error:  # pylint: disable=broad-except
      _warn(f"W&B did not finish cleanly ({_first_line(error)})")


def make(config: ml_collections.ConfigDict, workdir: str,
         records: dict[str, Any] | None = None) -> Tracker:
  """The W&B tracker of this run, or a no-op one when W&B is disabled or cannot start.

  `records` are the loop's `run_records` (the same as config.json's)."""
  mode = resolve_mode(config.wandb.mode)
  if mode == "disabled":
    return NoopTracker()
  # W&B's crash reporting (Sentry) would send its own payload off the machine; an explicit
  # WANDB_ERROR_REPORTING still wins. Read when W&B's service process starts, so set it first.
  os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
  import wandb  # pylint: disable=g-import-not-at-top  # Slow import; skipped when disabled.

  wandb_dir = os.path.join(workdir, "wandb")
  os.makedirs(wandb_dir, exist_ok=True)
  state_path = os.path.join(wandb_dir, _STATE_FILE)
  state = _load_state(state_path)
  run_id = state.get("id") or "".join(
      secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
  name, group, tags = scrub(run_names(config))
  logged_config = scrub(config.to_dict())
  logged_config.update(records or run_records(config))  # W&B's git capture is off.
  kwargs = dict(project=scrub(config.wandb.project), entity=scrub(config.wandb.entity) or None,
                name=name, group=group, tags=tags, job_type="train", config=logged_config,
                id=run_id, resume="allow", dir=workdir)
  before = set(os.listdir(wandb_dir))
  try:
    run = wandb.init(**kwargs, settings=_settings(wandb, mode))
  except Exception as error:  # pylint: disable=broad-except  # Never stop training.
    if mode != "online":
      _warn(f"W&B could not start ({_first_line(error)}); this run is not logged to W&B")
      return NoopTracker()
    _warn(f"W&B online start failed ({_first_line(error)}); falling back to offline; upload "
          f"later with `wandb sync {wandb_dir}/offline-run-*-{run_id}*`")
    _discard_failed_start(wandb, wandb_dir, before)
    try:
      run = wandb.init(**kwargs, settings=_settings(wandb, "offline"))
    except Exception as error:  # pylint: disable=broad-except
      _warn(f"W&B could not start offline either ({_first_line(error)}); not logging to W&B")
      return NoopTracker()
  resumed_step = int(state.get("last_step", 0)) if state.get("id") == run.id else 0
  # An online run resumed on the server knows its own last step, should run.json be lost.
  resumed_step = max(resumed_step, int(getattr(run, "step", 0) or 0) - 1)
  _save_state(state_path, run.id, resumed_step)
  workspace = workspace_dir(config, workdir)
  link_into_workspace(run.settings.sync_dir, workspace)
  where = (run.url if run.settings.mode == "online" else None) or (
      f"{run.settings.sync_dir} (every run: wandb leet {_shown(workspace)})")
  print(f"wandb: {run.settings.mode} run {run.id} ({name}, group {group})"
        + (f", resumed after step {resumed_step}" if resumed_step else "") + f": {where}",
        flush=True)
  return WandbTracker(run, state_path, resumed_step)


def workspace_dir(config: ml_collections.ConfigDict, workdir: str) -> str:
  """The project's shared W&B folder: `config.wandb.workspace`, or `wandb/` beside the
  workdir (`runs/wandb` for `--workdir runs/a`), so sibling runs land in one workspace."""
  parent = os.path.dirname(os.path.abspath(workdir))
  return config.wandb.workspace or os.path.join(parent, "wandb")


def link_into_workspace(run_dir: str, workspace: str) -> None:
  """Links a run folder into the workspace, where `wandb leet` and `wandb sync` find it.

  The link is relative, so a moved `runs/` folder keeps working; links whose run folder is
  gone (a deleted workdir) are dropped, so the workspace shows only runs that exist. A
  workspace that cannot be written costs a warning, never the run."""
  try:
    os.makedirs(workspace, exist_ok=True)
    for entry in os.listdir(workspace):
      path = os.path.join(workspace, entry)
      if os.path.islink(path) and not os.path.exists(path):
        with contextlib.suppress(FileNotFoundError):  # Another run may drop it first.
          os.remove(path)
    link = os.path.join(workspace, os.path.basename(run_dir))
    if not os.path.lexists(link):  # The run folder itself when the workspace is its own.
      os.symlink(os.path.relpath(run_dir, workspace), link)
  except OSError as error:
    _warn(f"cannot link the W&B run into {workspace} ({_first_line(error)}); its files are "
          f"in {run_dir}")


def _shown(path: str) -> str:
  """`path` relative to the current folder when it lies below it (the command to copy)."""
  relative = os.path.relpath(path)
  return path if relative.startswith("..") else relative


def _settings(wandb, mode: str):
  return wandb.Settings(
      mode=mode,
      init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT") or 30.0),
      silent=True,  # The one line `make` prints is enough.
      console="off",  # No copy of stdout/stderr in the run's files.
      x_disable_meta=True,  # No command line, host, user, executable or env-derived metadata.
      x_disable_machine_info=True,
      x_disable_stats=True,  # No system-metrics sampler (and its cloud metadata probes).
      disable_git=True, disable_code=True, save_code=False, x_save_requirements=False,
      disable_job_creation=True)


def _discard_failed_start(wandb, wandb_dir: str, before: set[str]) -> None:
  """Frees the run id the failed online start still holds and removes its empty run folder."""
  try:
    wandb.teardown()
  except Exception:  # pylint: disable=broad-except
    pass
  for entry in set(os.listdir(wandb_dir)) - before:
    path = os.path.join(wandb_dir, entry)
    if entry.startswith("run-") and os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)


def _load_state(path: str) -> dict[str, Any]:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def _save_state(path: str, run_id: str, last_step: int) -> None:
  write_atomically(path, json.dumps({"id": run_id, "last_step": last_step}))


def _first_line(error: BaseException) -> str:
  text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
  return scrub(text[:200])


def _warn(message: str) -> None:
  print(f"warning: {message}", flush=True)
