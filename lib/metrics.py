"""Per-step metrics: JSONL always; TensorBoard and Weights & Biases when installed and asked for."""
import json
import os
import time


class MetricsLogger:
    def __init__(self, run_dir: str, config: dict, *, tensorboard: bool = True, wandb_project: str | None = None,
                 resume_step: int | None = None):
        """`resume_step`: the step a resumed run continues from (see `continue_jsonl`); None = a fresh run."""
        os.makedirs(run_dir, exist_ok=True)
        self.path = continue_jsonl(os.path.join(run_dir, "metrics.jsonl"), resume_step)
        self._file = open(self.path, "a")
        self._start_s = time.time()
        self._tb = None
        self._wandb = None
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

    def close(self):
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


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
