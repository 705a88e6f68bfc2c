"""Per-step metrics: JSONL always; TensorBoard and Weights & Biases when installed and asked for."""
import json
import os
import time


class MetricsLogger:
    def __init__(self, run_dir: str, config: dict, *, tensorboard: bool = True, wandb_project: str | None = None):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
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


def _plain(v):
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        return v.item()
    return v
