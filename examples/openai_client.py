"""Talk to a running cadenza server with the official `openai` SDK.

    cadenza serve                      # in another terminal
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1

Streams a chat answer token by token, then asks for a plain completion.
"""

from __future__ import annotations

import argparse

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id  # a cadenza server serves one model
    print(f"model: {model}\n")

    print("chat (streamed): ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three things a KV cache stores."},
        ],
        max_completion_tokens=args.max_tokens,
        temperature=0.7,
        seed=7,  # sampled, yet the same answer every run on the same computation (README: a cached prompt)
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")

    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=args.max_tokens, temperature=0
    )
    choice = completion.choices[0]
    print(f"\ncompletion: {choice.text!r} (finish_reason={choice.finish_reason})")


if __name__ == "__main__":
    main()
