// What treeserve's OpenAI-compatible responses may carry beyond the `openai` SDK's declared
// types, for the type check of the saved responses (sdk_types_gen.mjs, run.sh). This file is
// the whole list: any other property the SDK's types do not declare fails the check.
import type { Completion, CompletionChoice } from "openai/resources/completions";

// Extension fields, added to the SDK's interfaces by declaration merging:
//  - `token_ids` (vLLM's `return_token_ids`): a choice's token ids, or a streamed chunk's.
declare module "openai/resources/completions" {
  interface CompletionChoice {
    token_ids?: Array<number>;
  }
}
declare module "openai/resources/chat/completions/completions" {
  namespace ChatCompletion {
    interface Choice {
      token_ids?: Array<number>;
    }
  }
  namespace ChatCompletionChunk {
    interface Choice {
      token_ids?: Array<number>;
    }
  }
}

// A streamed completion chunk. The SDK types its completion stream as Stream<Completion>,
// whose choices' `finish_reason` has no null and whose `usage` is absent or an object; its
// chat chunks, and OpenAI's completion stream, send `finish_reason: null` until a choice's
// last chunk and, with `stream_options.include_usage`, `usage: null` in every chunk but the
// last. Those two fields may be null here; everything else is the SDK's Completion.
export type CompletionChunk = Omit<Completion, "choices" | "usage"> & {
  choices: Array<
    Omit<CompletionChoice, "finish_reason"> & {
      finish_reason: CompletionChoice["finish_reason"] | null;
    }
  >;
  usage?: Completion["usage"] | null;
};
