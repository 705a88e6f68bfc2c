"""The embedded tiny model: a byte-level BPE tokenizer trained on the bundled data and a randomly
initialised Qwen2ForCausalLM of a few million parameters, saved in HF format.

The result loads with `AutoTokenizer.from_pretrained(path)` / `AutoModelForCausalLM.from_pretrained(path)`
exactly like Qwen2.5 from the hub, so every code path (CPU server, SGLang, actor, chat templates)
is the one the real recipe uses. Built deterministically on first use and cached; nothing binary
lives in git.
"""
import hashlib
import json
import os
from typing import Iterable

import torch

from lib.cache import build_once, cache_root

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML as Qwen2.5 renders it (no default system prompt, so short contexts stay short).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The same ChatML with tool calling laid out as Qwen2.5 lays it out (tools as JSON in the system
# turn, calls as <tool_call>{"name", "arguments"}</tool_call>, results as <tool_response> blocks in
# a user turn), shortened for a small context. A conversation without tools renders exactly as
# CHAT_TEMPLATE does. Installed by the tool-calling warm start (examples/langgraph_search.py);
# the base model keeps CHAT_TEMPLATE, so its cache and the warm starts built on it stay valid.
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- (tool['function'] if tool['function'] is defined else tool) | tojson }}{%- endfor %}"
    "{{- '\n</tools>\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + (fn['arguments'] | tojson) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

DEFAULT_ARCH = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=768,
    max_position_embeddings=4096,
)

# Words every agent prompt uses; they keep the tokenizer efficient on templates the corpus lacks.
_TEMPLATE_TEXT = """<think> </think> <search> </search> <information> </information> <access> </access>
<answer> </answer> Answer the given question. You must conduct reasoning inside <think> and </think>
first every time you get new information. After reasoning, if you find you lack some knowledge, you
can call a search engine by <search> query </search> and it will return the top searched results
between <information> and </information>. You can search as many times as you want. If you find no
further external knowledge needed, you can directly provide the answer inside <answer> and </answer>,
without detailed illustrations. For example, <answer> Beijing </answer>. Question: Your answer is
either wrong or not parsable to the reference answer. Please try to answer it more accurately.
Solve the problem step by step. Put the final answer after ####. The answer is """


def _train_tokenizer(texts: Iterable[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=DEFAULT_ARCH["max_position_embeddings"],
    )


def build_tiny_model(out_dir: str, texts: Iterable[str], *, seed: int = 0, **arch) -> str:
    """Train the tokenizer on `texts`, initialise a Qwen2 model from `seed`, save both to `out_dir`."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    arch = {**DEFAULT_ARCH, **arch}
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = _train_tokenizer(list(texts) + [_TEMPLATE_TEXT] * 20, arch["vocab_size"])
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    # Round the embedding up to a multiple of 64, as Qwen does: friendlier to GPU kernels and tp.
    vocab_size = (len(tokenizer) + 63) // 64 * 64
    config = Qwen2Config(
        **{**arch, "vocab_size": vocab_size},
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id)

    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def default_texts(seed: int = 0) -> list[str]:
    """The bundled data the embedded tokenizer is trained on: the synthetic encyclopedia and its
    questions, and the synthetic arithmetic word problems."""
    from lib import math_data, wiki_data

    texts = list(wiki_data.iter_wiki_texts(wiki_data.default_wiki_dir(seed=seed)))
    texts += list(math_data.iter_math_texts(math_data.default_math_dir(seed=seed)))
    return texts


def default_tiny_model_dir(seed: int = 0, extra_texts: list[str] | None = None, **arch) -> str:
    """Path of the embedded tiny model, building it (and the data it is trained on) on first use.
    `extra_texts`: a fork's own texts (its prompt, demonstrations, tool output) for the tokenizer to
    learn beside the bundled data, so that text the bundled data never shows (upper-case SQL, code)
    is not cut into single characters; the model is then cached under them."""
    from lib import math_data, wiki_data

    # The tokenizer is trained on the bundled data: a new data generator means a new model.
    data = {"wiki": wiki_data.GENERATOR_VERSION, "math": math_data.GENERATOR_VERSION}
    if extra_texts:
        data["extra"] = hashlib.sha1("\x00".join(extra_texts).encode()).hexdigest()
    key = hashlib.sha1(json.dumps({**DEFAULT_ARCH, **arch, "seed": seed, "data": data},
                                  sort_keys=True).encode()).hexdigest()[:8]
    out_dir = os.path.join(cache_root(), f"tiny-qwen2-{key}")
    return build_once(out_dir, lambda tmp: build_tiny_model(tmp, default_texts(seed) + list(extra_texts or []),
                                                            seed=seed, **arch))
