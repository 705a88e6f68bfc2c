"""Per-step metrics: JSONL always; TensorBoard, Weights & Biases and MLflow (metrics and traces) when
installed and asked for."""
import json
import os
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: str, config: dict, *, tensorboard: bool = True, wandb_project: str | None = None,
                 resume_step: int | None = None, mlflow: bool = False):
        """`resume_step`: the step a resumed run continues from (see `continue_jsonl`); None = a fresh run.
        `mlflow`: also log metrics and traces to MLflow, at `MLFLOW_TRACKING_URI` when it is set, else in
        `run_dir/mlflow.db` (`mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db` shows it)."""
        os.makedirs(run_dir, exist_ok=True)
        # the run's settings beside its metrics (the viewer's config table reads it); written whole or not at all
        tmp = os.path.join(run_dir, "config.json.tmp")
        with open(tmp, "w") as f:
            json.dump(config, f, indent=1, default=str)
        os.replace(tmp, os.path.join(run_dir, "config.json"))
        self.path = continue_jsonl(os.path.join(run_dir, "metrics.jsonl"), resume_step)
        self._file = open(self.path, "a")
        self._start_s = time.time()
        self._tb = None
        self._wandb = None
        self._mlflow = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
            except ImportError:
                pass
        if wandb_project:
            try:
                import wandb

                self._wandb = wandb.init(project=wandb_project, config=config, dir=run_dir)
            except ImportError:
                print("wandb is not installed; logging to JSONL (and TensorBoard) only")
        if mlflow:
            self._mlflow = start_mlflow_run(run_dir, config)

    def log(self, step: int, metrics: dict):
        row = {"step": step, "time/wall_s": round(time.time() - self._start_s, 2)}
        row.update({k: _plain(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for k, v in row.items():
            if isinstance(v, (int, float)) and k != "step":
                if self._tb is not None:
                    self._tb.add_scalar(k, v, step)
        if self._tb is not None:
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
        if self._mlflow is not None:
            self._mlflow.log_metrics({k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"},
                                     step=step)

    def log_traces(self, step: int, records: list[dict]):
        """A step's trace records (lib/traces.py) to MLflow, when it is on: one trace per episode with a
        span per turn (MLflow's Traces tab shows them as conversations), and the records, tokens
        included, as the artifact `traces/step_NNNNNN.json`. traces.jsonl is written by the script."""
        if self._mlflow is None:
            return
        mlflow = self._mlflow
        for r in records:
            with mlflow.start_span(name=f"step {step} group {r['group']} episode {r['index']}", span_type="AGENT") as ep:
                ep.set_inputs({"question": r["question"], "prompt": r["prompt"]})
                ep.set_attributes({"step": step, "group": r["group"], "reward": r["reward"],
                                   "advantage": r["advantage"], "finish": r["finish"]})
                for turn in r["turns"]:
                    with mlflow.start_span(name=turn["role"], span_type="LLM" if turn["role"] == "model" else "TOOL") as sp:
                        sp.set_outputs({"text": turn["text"]})
                ep.set_outputs({"answer": r["answer"], "reward": r["reward"]})
        mlflow.log_dict(records, f"traces/step_{step:06d}.json")

    def close(self):
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.flush_trace_async_logging()  # traces are exported in the background
            self._mlflow.end_run()


def start_mlflow_run(run_dir: str, config: dict):
    """The mlflow module with a run started for `run_dir`, or None (with a message) when it is not installed."""
    try:
        import mlflow
    except ImportError:
        print("mlflow is not installed (pip install mlflow); logging to JSONL (and TensorBoard) only")
        return None
    if os.environ.get("MLFLOW_TRACKING_URI"):
        mlflow.set_experiment("agentrl")
    else:  # everything in the run dir (artifacts would otherwise land in ./mlruns of the working directory)
        mlflow.set_tracking_uri(f"sqlite:///{os.path.abspath(os.path.join(run_dir, 'mlflow.db'))}")
        experiment = mlflow.get_experiment_by_name("agentrl")
        mlflow.set_experiment(experiment_id=experiment.experiment_id if experiment else mlflow.create_experiment(
            "agentrl", artifact_location=Path(os.path.abspath(run_dir), "mlflow-artifacts").as_uri()))
    mlflow.start_run(run_name=os.path.basename(os.path.abspath(run_dir)))
    mlflow.log_params({k: str(v)[:500] for k, v in config.items()})
    return mlflow


def continue_jsonl(path: str, resume_step: int | None) -> str:
    """Make the per-step JSONL file at `path` hold one run: for a fresh run (`resume_step` None) an
    existing file is moved aside (`NAME.before-YYYYmmdd-HHMMSS.jsonl`); for a run resumed at
    `resume_step` the rows of later steps, which the killed run logged after its checkpoint and the
    resumed run logs again, are dropped. Returns `path`."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return path
    if resume_step is None:
        aside = f"{path[:-len('.jsonl')]}.before-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        os.replace(path, aside)
        print(f"{path} held an earlier run; moved it to {aside}")
        return path
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) <= resume_step:
                kept.append(line)
        except ValueError:  # a line cut by the kill
            continue
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return path


def _plain(v):
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        return v.item()
    return v
