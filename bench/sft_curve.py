"""Bookkeeping shared by the warm-start curve scripts (bench/warm_start_curve.py,
bench/reflect_warm_start_curve.py): `lib.warm_start.sft_warm_start` calls back every N steps; each
call hands the model to the inference server, the script evaluates, and the row is printed and
appended to a JSONL file. Training seconds exclude the evaluations."""
import json
import os
import time


class CurveRecorder:
    def __init__(self, work: str, device: str, client, loop, out: str = ""):
        self.work, self.device, self.client, self.loop, self.out = work, device, client, loop, out
        self.train_s, self.last, self.eval_start = 0.0, time.time(), 0.0

    def load_on_server(self, step: int, model, tokenizer) -> None:
        """Stop the training clock, save the model (HF format, CPU) and have the server load it."""
        self.train_s += time.time() - self.last
        path = os.path.join(self.work, f"step{step}")
        model.to("cpu").save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        model.to(self.device)
        self.eval_start = time.time()
        self.loop.run_until_complete(self.client.update_weights_from_disk(path))

    def record(self, row: dict) -> dict:
        """`row` with train_s and eval_s first; printed, appended to `out`; the training clock restarts."""
        row = {"train_s": round(self.train_s, 1), "eval_s": round(time.time() - self.eval_start, 1), **row}
        print(json.dumps(row), flush=True)
        if self.out:
            with open(self.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        self.last = time.time()
        return row
