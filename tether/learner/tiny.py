"""The pieces of the embedded ``tiny`` model: special tokens, chat template, built-in corpus, tokenizer.

The tokenizer is a byte-level BPE trained with HF ``tokenizers`` using *Qwen2's own* normalizer and
pre-tokenizer, because ``AutoTokenizer`` loads a ``model_type: qwen2`` folder as ``Qwen2Tokenizer`` and
rebuilds those two pieces from code (cpu-facts): training with anything else changes the ids on reload.
A consequence of that pre-tokenizer: digits are always one token each.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer
from transformers.tokenization_utils_base import AddedToken

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CONTROL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # special: dropped by decode(skip_special_tokens=True)
# Not "special" (as in Qwen2.5), so that decoded text keeps them for the tool-call parser.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# ChatML with Hermes/Qwen2.5-style tool calls and results, worded short: the tiny model has a small context,
# so each tool is listed as one signature line, `name(param, ...): description`, not as its JSON schema.
CHAT_TEMPLATE = """\
{%- if messages and messages[0].role == 'system' %}{% set system = messages[0].content %}\
{% set rest = messages[1:] %}{% else %}{% set system = none %}{% set rest = messages %}{% endif %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}{% if system %}{{ system + '\\n\\n' }}{% endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}\
{{ '\\n' + f.name + '(' + ((f.parameters.properties if f.parameters is defined and f.parameters.properties is defined \
else {}) | list | join(', ')) + ')' }}{% if f.description %}{{ ': ' + f.description }}{% endif %}{% endfor %}
{{- '\\n</tools>\\nTo call a tool, reply with:\\n<tool_call>\\n' }}
{{- '{"name": <name>, "arguments": <args>}\\n</tool_call><|im_end|>\\n' }}
{%- elif system %}
{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in rest %}
{%- if message.role == 'tool' %}
{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}{% if message.content %}{{ '\\n' + message.content }}{% endif %}
{%- for call in message.tool_calls %}
{%- if call.function is defined %}{% set call = call.function %}{% endif %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{ call.arguments }}{% else %}{{ call.arguments | tojson }}{% endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
"""

# --- built-in corpus: enough JSON, tool traffic and customer-service English for compact ids ---------

_TOOLS = {
    "query_inventory": {"sku_id": "string"},
    "check_refund_policy": {"order_id": "string", "reason_code": "string"},
    "escalate_to_human": {"summary": "string", "priority": "string"},
    "respond_to_user": {"message": "string"},
    "get_order_status": {"order_id": "string"},
    "lookup_customer": {"email": "string"},
    "issue_refund": {"order_id": "string", "amount": "number"},
    "search": {"query": "string", "limit": "integer"},
    "calculator": {"expression": "string"},
    "get_weather": {"city": "string", "unit": "string"},
}
_WORDS = (
    "order refund shipping delivery package tracking account password email address payment card invoice "
    "price discount coupon return exchange warranty damaged broken missing late item product size color stock "
    "inventory available store customer support agent manager policy days receipt reason status pending "
    "shipped delivered cancelled processing approved denied eligible request help issue problem thanks please "
    "sorry today tomorrow yesterday week month number total amount quantity cost balance credit charge fee "
    "the a an and or but if then so because with without for from to of in on at by about into after before "
    "is are was were be been have has had do does did can could will would should may might must not no yes "
    "I you he she it we they my your our their this that these those what which who when where why how "
    "check find send call ask tell give take make get see know need want like think look use try keep let "
    "new old good bad first last next other same right wrong small large fast slow high low urgent normal "
    "user assistant tool result error message name value type object string integer number boolean true false "
    "weather city temperature search query limit expression answer question summary priority reason_code "
    "time day year hour minute second morning evening night phone mobile home work office company business "
    "service team member people person family friend name list page file data report record history note "
    "system model server network internet website online offline app update version change update upgrade "
    "open close start stop begin end finish complete cancel confirm verify review approve reject accept "
    "buy sell pay spend save lose win move carry bring hold turn show hide print read write speak talk "
    "call answer reply respond contact reach wait hope expect believe feel seem become remain stay leave "
    "arrive deliver ship pack wrap label scan count measure weigh compare choose select pick prefer decide "
    "money dollar euro cent bank transfer refund deposit withdraw loan interest rate tax bill budget "
    "address street road house room door window floor table chair box bag bottle shoe shirt dress jacket "
    "phone laptop screen keyboard battery charger cable camera watch headphones speaker printer monitor "
    "book pen paper letter card gift toy game ball bike car train plane ticket hotel trip travel flight "
    "food water coffee tea milk bread rice fruit apple orange banana meat fish chicken egg cheese sugar "
    "red blue green yellow black white gray brown pink purple orange silver gold light dark bright clear "
    "happy sad angry calm busy free full empty easy hard simple complex quick careful important possible "
    "every each all some any many much more most few less least other another such only own same both "
    "again also already always never often sometimes usually still just even really very quite almost "
    "here there now soon later once twice above below under over between through during until while "
    "problem solution option choice detail information instruction question request response feedback "
    "account profile setting password login logout username security access permission role admin guest"
).split()
_PHRASES = (
    "Hi, I need help with my order {o}.", "Where is my package? The tracking number is {n}.",
    "I want a refund for order {o} because the item arrived damaged.", "Can you check if {s} is in stock?",
    "Your order {o} was shipped on day {d} and should arrive in {k} days.",
    "The refund of {p} dollars has been approved.", "I am sorry, order {o} is not eligible for a refund.",
    "Let me check the inventory for {s}.", "I have escalated your issue to a human agent.",
    "Thank you for contacting support. Is there anything else I can help with?",
    "Please confirm your email address.", "The total is {p} and the discount is {k} percent.",
)


def _inflect(rng: random.Random, word: str) -> str:
    word = word + rng.choice(("", "", "", "s", "ed", "ing", "er", "ly", "able", "ment", "ness"))
    word = rng.choice(("", "", "", "", "", "un", "re", "pre")) + word
    return word.capitalize() if rng.random() < 0.15 else word


def _value(rng: random.Random, kind: str, key: str) -> object:
    if kind == "number":
        return round(rng.uniform(1, 500), 2)
    if kind == "integer":
        return rng.randint(1, 100)
    if key.endswith("_id"):
        return f"{key[:3].upper()}-{rng.randint(1000, 99999)}"
    if key == "priority":
        return rng.choice(["low", "normal", "high", "urgent"])
    return " ".join(_inflect(rng, rng.choice(_WORDS)) for _ in range(rng.randint(1, 6)))


def _fill(rng: random.Random, phrase: str) -> str:
    return phrase.format(o=f"ORD-{rng.randint(1000, 99999)}", s=f"SKU-{rng.randint(100, 9999)}",
                         n=rng.randint(10**6, 10**9), d=rng.randint(1, 28), k=rng.randint(1, 14),
                         p=round(rng.uniform(1, 500), 2))


def tool_schema(name: str) -> dict:
    """OpenAI-format schema of one of the built-in corpus tools (also handy in tests)."""
    params = _TOOLS[name]
    return {"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ').capitalize()}.",
        "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in params.items()},
                       "required": list(params)}}}


def builtin_corpus(n: int = 2000, seed: int = 1234) -> Iterator[str]:
    """Deterministic synthetic text: tool schemas, tool calls, tool results, chat turns, numbers."""
    rng = random.Random(seed)
    names = sorted(_TOOLS)
    for name in names:
        yield json.dumps(tool_schema(name))
    for _ in range(n):
        name = rng.choice(names)
        args = {k: _value(rng, t, k) for k, t in _TOOLS[name].items()}
        result = {"status": rng.choice(["ok", "error", "pending"]), rng.choice(_WORDS): _value(rng, "string", "x"),
                  "amount": round(rng.uniform(0, 900), 2), "count": rng.randint(0, 50)}
        yield (f"{IM_START}user\n{_fill(rng, rng.choice(_PHRASES))}{IM_END}\n"
               f"{IM_START}assistant\n<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
               f"{IM_END}\n{IM_START}user\n<tool_response>\n{json.dumps(result)}\n</tool_response>{IM_END}\n"
               f"{IM_START}assistant\n{_fill(rng, rng.choice(_PHRASES))}{IM_END}\n")
        yield " ".join(_inflect(rng, rng.choice(_WORDS)) for _ in range(rng.randint(5, 25))) + rng.choice(".?!")
        key = lambda: "_".join(rng.sample(_WORDS, rng.randint(1, 2)))  # noqa: E731
        yield json.dumps({key(): _value(rng, rng.choice(("string", "number", "integer")), key())
                          for _ in range(rng.randint(1, 4))})
        yield f"{rng.randint(0, 10**6)} {rng.uniform(0, 1000):.2f} {rng.randint(1, 12)}/{rng.randint(1, 28)}"


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 2048) -> Qwen2Tokenizer:
    """Byte-level BPE on ``corpus``, wrapped as the ``Qwen2Tokenizer`` that AutoTokenizer will rebuild."""
    raw = Tokenizer(BPE())
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[*CONTROL_TOKENS, *TOOL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(corpus, trainer)
    model = json.loads(raw.to_str())["model"]
    # transformers types merges as list[str] and unk_token as str; the BPE model takes pairs and no unk token.
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]],  # type: ignore[misc]
                         eos_token=IM_END, pad_token=ENDOFTEXT, unk_token=None)  # type: ignore[arg-type]
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tok.chat_template = CHAT_TEMPLATE
    return tok
