"""A live treeserve serving the Llama-3-style directory (random weights): Tokenize and
Detokenize give what the tokenizer comparison checked, text prompts start with BOS, and a
greedy Generate streams text equal to the decode of its tokens.

    python3 serve_check.py TARGET SOURCE_DIR STRINGS.jsonl OURS.jsonl
"""
import json
import os
import sys


def main():
    target, src, strings_file, ours_file = sys.argv[1:5]
    sys.path.insert(0, os.path.join(src, "clients", "python"))
    from treeserve import TreeServeClient, finish_reason_name, is_idle

    client = TreeServeClient(target, timeout=60)
    strings = [json.loads(line) for line in open(strings_file, encoding="utf-8")]
    ours = [json.loads(line) for line in open(ours_file, encoding="utf-8")][1:]
    failures = []
    checked = 0
    for i in range(0, len(strings), 40):  # 300 strings spread over every kind
        s, expected = strings[i], ours[i]
        if not s:
            continue
        checked += 1
        ids = client.tokenize(s)
        if ids != expected["ids"]:
            failures.append("Tokenize(%r) = %s, expected %s" % (s, ids, expected["ids"]))
        text = client.detokenize(expected["ids"]) if expected["ids"] else ""
        if text != expected["decoded_skip"]:
            failures.append("Detokenize of string %d = %r, expected %r"
                            % (i, text, expected["decoded_skip"]))
    vocab = client.vocab_size()
    if vocab != 128256:
        failures.append("vocabulary size %d, expected 128256" % vocab)

    hello = client.tokenize("Hello world")
    tree = client.create_tree("Hello world")
    if tree.prompt_tokens != len(hello) + 1:
        failures.append("a text prompt of %d tokens became %d tokens (expected BOS + text)"
                        % (len(hello), tree.prompt_tokens))
    streams = client.generate_collect(tree.tree_id, [tree.root_branch_id], max_tokens=12,
                                      temperature=0.0)
    for branch, stream in streams.items():
        joined = "".join(stream.text)
        decoded = client.detokenize(stream.token_ids)
        if joined != decoded:
            failures.append("branch %s streamed %r, its tokens decode to %r"
                            % (branch, joined, decoded))
        print("generated %d tokens (%s): %r" % (len(stream.token_ids),
                                                finish_reason_name(stream.finish_reason), joined))
    client.delete_tree(tree.tree_id)
    if not is_idle(client.wait_idle()):
        failures.append("KV pages still held after deleting the tree")
    print("checked Tokenize/Detokenize on %d strings" % checked)
    for f in failures[:20]:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
