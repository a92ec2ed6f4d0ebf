"""Reference token ids for the C++ tokenizers, from transformers / tokenizers.

Writes into OUTDIR:
  tokenizer.json (+ tokenizer_config.json)  transformers' tokenizer built from the GGUF, via save_pretrained
  cases.json     [{"text", "ids"}]: that tokenizer's ids (no special tokens added) for every case text
  variants.json  [{"name", "file", "roundtrip", "ids", "ids_with_bos"}]: the same vocabulary under other
                 normalizers / pre-tokenizers / post-processors (Llama-3, Qwen2, the hub's SmolLM2 style and
                 every Split behaviour), each saved as variants/NAME/tokenizer.json and encoded by `tokenizers`
  stories260K_tok512.gguf  assets/stories260K/tok512.bin's pieces as a metadata-only GGUF
                 (tokenizer.ggml.model = llama)
"""
import copy
import json
import os
import struct
import sys

from tokenizers import Tokenizer
from transformers import AutoTokenizer

CASES = [
    "",
    "Hello world",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "   three leading spaces",
    "two  spaces  between",
    "tabs\tand\ttabs",
    "\ttab first",
    "line one\nline two",
    "\n\nblank lines\n\n\n",
    "windows\r\nnewlines\r\n",
    "mixed \t \n whitespace \n\t ",
    "a  1",
    "price: $1234.56, or 1,000,000 dollars",
    "3.14159265358979323846264338327950288",
    "2024-01-15T12:30:00Z",
    "phone +1 (555) 010-9999",
    "year 1999 and 2000s",
    "x1y2z3 abc123def",
    "I'm sure you're right, it's what they've said and we'll see; I'd go",
    "DON'T SHOUT, IT'S LOUD",
    "don't can't won't shouldn't",
    "café naïve résumé façade",
    "Ünïcödé Àccénts ñ ß ø å",
    "日本語のテキストです。",
    "中文文本，包含标点符号。",
    "한국어 텍스트",
    "Русский текст с пунктуацией.",
    "Ελληνικά γράμματα",
    "مرحبا بالعالم",
    "שלום עולם",
    "हिन्दी पाठ",
    "emoji 🙂🎉👍🏽 and 👨‍👩‍👧‍👦 family",
    "flags 🇫🇷🇯🇵",
    "math ∑∫√∞ ≤ ≥ ≠ ±",
    "zero\u200bwidth\u200cjoiners\u200d",
    "non\u00a0breaking\u2003spaces",
    "combining e\u0301 vs é",
    "ﬁ ligature and ² superscript and ½ fraction",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "#include <vector>\nint main() { return 0; }",
    "SELECT * FROM users WHERE id = 42;",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    "<html><body><p class=\"x\">Hi</p></body></html>",
    "path/to/file.txt and C:\\Windows\\System32",
    "https://example.com/search?q=tokenizer&lang=en#top",
    "user@example.com",
    "snake_case_identifier and camelCaseIdentifier and SCREAMING_CASE",
    "!!!???...,,,;;;:::",
    "----- ===== ***** #####",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "text before <|im_start|>inside<|im_end|> text after",
    "<|endoftext|>",
    "<|im_start|><|im_end|><|endoftext|>",
    "not special: <|im_start and im_end|>",
    "<repo_name>kvbound<file_sep>main.cpp",
    "Once upon a time, there was a little girl named Lily.",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "a" * 300,
    " " * 40,
    "ab" * 100 + " " + "xyz" * 50,
    "MiXeD CaSe WoRdS",
    "hello world hello earth",
    "hello\u3000world",
    "\u0085next line\u000bvertical tab\u000cform feed",
    "Ω≈ç√∫˜µ≤≥÷",
    "tokenization is fun",
    "fill  [MASK]  in and [MASK]",
    "sayhello world, hello worlds",
    "say hello world.",
]

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_level(add_prefix_space=False, use_regex=False):
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": True, "use_regex": use_regex}


def split(pattern, behavior, invert=False, literal=False):
    return {"type": "Split", "pattern": {"String" if literal else "Regex": pattern}, "behavior": behavior,
            "invert": invert}


def sequence(*steps):
    return {"type": "Sequence", "pretokenizers": list(steps)}


def bos_template(token, token_id):
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {token: {"id": token, "ids": [token_id], "tokens": [token]}}}


def variants(base):
    """(name, tokenizer.json dict, decode(encode(s)) == s expected) over the base vocabulary."""
    vocab_size = len(base["model"]["vocab"])

    def derive(**changes):
        j = copy.deepcopy(base)
        for key, value in changes.items():
            j[key] = value
        return j

    hub_smollm2 = derive(pre_tokenizer=sequence({"type": "Digits", "individual_digits": True},
                                                byte_level(use_regex=True)))
    llama3 = derive(pre_tokenizer=sequence(split(LLAMA3_REGEX, "Isolated"), byte_level()),
                    post_processor={"type": "Sequence", "processors": [
                        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
                        bos_template("<|im_start|>", 1)]})
    llama3["model"]["ignore_merges"] = True
    llama3["model"]["merges"] = [m.split(" ") if isinstance(m, str) else m for m in llama3["model"]["merges"]]
    qwen2 = derive(normalizer={"type": "NFC"}, pre_tokenizer=sequence(split(QWEN2_REGEX, "Isolated"), byte_level()))
    prefix_space = derive(pre_tokenizer=byte_level(add_prefix_space=True, use_regex=True))
    prefix_space["added_tokens"] += [
        {"id": vocab_size, "content": "[MASK]", "single_word": False, "lstrip": True, "rstrip": True,
         "normalized": False, "special": True},
        {"id": vocab_size + 1, "content": "hello world", "single_word": True, "lstrip": False, "rstrip": False,
         "normalized": True, "special": False},
        {"id": vocab_size + 2, "content": "CaSe", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": True, "special": False},
    ]
    nfkc = derive(normalizer={"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "NFKC"}]})
    merged_previous = derive(pre_tokenizer=sequence(split(r"\s+", "MergedWithPrevious"), byte_level()))
    merged_next = derive(pre_tokenizer=sequence(split(" ", "MergedWithNext", literal=True), byte_level()))
    contiguous = derive(pre_tokenizer=sequence(split(r"\p{L}", "Contiguous", invert=True),
                                               byte_level(use_regex=True)))
    removed = derive(pre_tokenizer=sequence(split(r"\s", "Removed"), {"type": "Digits", "individual_digits": False},
                                            byte_level()))
    return [("hub_smollm2", hub_smollm2, True), ("llama3", llama3, True), ("qwen2", qwen2, False),
            ("prefix_space", prefix_space, False), ("nfkc", nfkc, False), ("merged_previous", merged_previous, True),
            ("merged_next", merged_next, True), ("contiguous_invert", contiguous, True), ("removed", removed, False)]


def write_json(path, value):
    with open(path + ".part", "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False)
    os.replace(path + ".part", path)


def write_tok512_gguf(out_dir):
    """tok512.bin's pieces as a sentencepiece-style GGUF vocabulary (spaces spelled U+2581)."""
    import gguf

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "assets", "stories260K", "tok512.bin")
    data = open(path, "rb").read()
    offset, pieces, scores = 4, [], []
    while offset < len(data):
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        pieces.append(data[offset:offset + length].decode("utf-8"))
        scores.append(score)
        offset += length
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 259)
    writer = gguf.GGUFWriter(os.path.join(out_dir, "stories260K_tok512.gguf.part"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([p.replace(" ", "\u2581") for p in pieces])
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(os.path.join(out_dir, "stories260K_tok512.gguf.part"), os.path.join(out_dir, "stories260K_tok512.gguf"))


def main(gguf_path, out_dir):
    if not os.path.exists(gguf_path):
        print(f"missing {gguf_path}; run scripts/setup.sh", file=sys.stderr)
        sys.exit(1)
    os.makedirs(out_dir, exist_ok=True)
    folder, name = os.path.split(os.path.abspath(gguf_path))
    reference = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    reference.save_pretrained(out_dir)
    write_json(os.path.join(out_dir, "cases.json"),
               [{"text": text, "ids": reference.encode(text, add_special_tokens=False)} for text in CASES])

    with open(os.path.join(out_dir, "tokenizer.json"), encoding="utf-8") as f:
        base = json.load(f)
    listed = []
    for variant, spec, roundtrip in variants(base):
        folder = os.path.join(out_dir, "variants", variant)
        os.makedirs(folder, exist_ok=True)
        write_json(os.path.join(folder, "tokenizer.json"), spec)
        tokenizer = Tokenizer.from_str(json.dumps(spec))
        listed.append({"name": variant, "file": f"variants/{variant}/tokenizer.json", "roundtrip": roundtrip,
                       "ids": [tokenizer.encode(t, add_special_tokens=False).ids for t in CASES],
                       "ids_with_bos": [tokenizer.encode(t, add_special_tokens=True).ids for t in CASES]})
    write_json(os.path.join(out_dir, "variants.json"), listed)
    write_tok512_gguf(out_dir)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
