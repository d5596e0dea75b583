#!/usr/bin/env python3
"""Renders the chat-template cases with Hugging Face transformers and compares them with the
expected strings that treeserve's CPU tests check (tests/models/chat_template_test.cpp):

  conversations.json  the family templates (*.jinja here) on conversations, with the special
                      tokens and template variables each case passes;
  jinja_cases.json    small templates, one per interpreter feature.

    python3 check_with_transformers.py            # transformers' apply_chat_template
    python3 check_with_transformers.py --jinja2   # Jinja2 in transformers' environment, for a
                                                  # machine without transformers
    python3 check_with_transformers.py --jinja2 --write   # rewrites the expected strings

A case passes when the renderer's output equals "expected", or, for a case with "error", when
rendering fails and the message contains that text ("" = any failure). Prints a diff of every
mismatch and exits 1 if there is one.
"""
import argparse
import datetime as datetime_module
import difflib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MESSAGES = [{"role": "user", "content": "hi"}]


class FixedClock(datetime_module.datetime):
    """datetime whose now() is the case's "now" (epoch seconds), for strftime_now."""
    fixed = None
    pinned = True  # whether the renderer's strftime_now reads this class

    @classmethod
    def now(cls, tz=None):
        if cls.fixed is None:
            return datetime_module.datetime.now(tz)
        return datetime_module.datetime.fromtimestamp(cls.fixed, tz)


def jinja2_renderer():
    """transformers' _compile_jinja_template, restated: the same environment and globals."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class AssistantTracker(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return FixedClock.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now

    def render(template, messages, add_generation_prompt, tools, variables):
        compiled = env.from_string(template)
        return compiled.render(messages=messages, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **variables)

    return render, "Jinja2 " + jinja2.__version__ + " (transformers' environment)"


def transformers_renderer():
    import transformers
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    # A tokenizer with no special tokens: every template variable comes from the case.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab={"[UNK]": 0}, unk_token="[UNK]")))
    # strftime_now reads datetime.now() from the module that defines it; a version where it
    # is not found there cannot pin the clock, and the cases that need it are skipped.
    FixedClock.pinned = False
    for name in ("transformers.utils.chat_template_utils", "transformers.tokenization_utils_base"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "datetime", None) is datetime_module.datetime:
            module.datetime = FixedClock
            FixedClock.pinned = True

    def render(template, messages, add_generation_prompt, tools, variables):
        return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template,
                                             add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **variables)

    return render, "transformers " + transformers.__version__ + " apply_chat_template"


def run_case(render, template, case, messages, add_generation_prompt):
    variables = dict(case.get("variables", {}))
    variables.pop("messages", None)
    FixedClock.fixed = case.get("now")
    try:
        return render(template, messages, add_generation_prompt, case.get("tools"), variables), None
    except Exception as e:  # the template's own failure is what error cases check
        return None, "%s: %s" % (type(e).__name__, e)
    finally:
        FixedClock.fixed = None


def check(render, path, write):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    failures = skipped = 0
    for i, case in enumerate(data["cases"]):
        if "template" in case and case["template"].endswith(".jinja"):
            with open(os.path.join(HERE, case["template"]), encoding="utf-8") as f:
                template = f.read()
            messages = case["messages"]
            add_generation_prompt = case.get("add_generation_prompt", True)
        else:
            template = case["template"]
            messages = case.get("variables", {}).get("messages", DEFAULT_MESSAGES)
            add_generation_prompt = False
        name = case.get("name", "%s #%d: %r" % (os.path.basename(path), i, template[:60]))
        if "now" in case and not FixedClock.pinned:
            print("SKIP %s: this transformers' strftime_now clock cannot be pinned" % name)
            skipped += 1
            continue
        out, error = run_case(render, template, case, messages, add_generation_prompt)
        if "error" in case:
            if error is None:
                failures += 1
                print("FAIL %s: expected an error (%r), rendered %r" % (name, case["error"], out))
            elif case["error"] not in error:
                failures += 1
                print("FAIL %s: the error %r does not contain %r" % (name, error, case["error"]))
            continue
        if error is not None:
            failures += 1
            print("FAIL %s: %s" % (name, error))
            continue
        if write:
            case["expected"] = out
            continue
        if out != case.get("expected"):
            failures += 1
            print("FAIL %s:" % name)
            expected = (case.get("expected") or "").splitlines(keepends=True)
            for line in difflib.unified_diff(expected, out.splitlines(keepends=True),
                                             "expected (treeserve's tests)", "rendered", lineterm=""):
                print("    " + repr(line))
    if write:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, ensure_ascii=False)
            f.write("\n")
    return len(data["cases"]) - skipped, failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jinja2", action="store_true",
                        help="render with Jinja2 in transformers' environment instead")
    parser.add_argument("--write", action="store_true", help="rewrite the expected strings")
    args = parser.parse_args()
    render, what = jinja2_renderer() if args.jinja2 else transformers_renderer()
    total = failed = 0
    for name in ("conversations.json", "jinja_cases.json"):
        n, f = check(render, os.path.join(HERE, name), args.write)
        total += n
        failed += f
    print("%s: %d cases checked, %d passed, %d failed" % (what, total, total - failed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
