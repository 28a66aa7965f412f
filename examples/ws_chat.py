"""An interactive terminal chat over a cadenza WebSocket session.

    python examples/ws_chat.py [--url ws://127.0.0.1:8000/v1/sessions] [--system "Be brief."] [--temperature 0.7]

The conversation lives on the server: each line you type is one user turn, and follow-ups reuse
the cached prefix of the turns before. Ctrl-C while the model answers interrupts it (the partial
answer stays in the conversation); Ctrl-C at the prompt, or Ctrl-D, quits. Answers are greedy
(temperature 0) unless --temperature says otherwise, so the same questions get the same answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from websockets.asyncio.client import connect


async def chat(url: str, system: str | None, api_key: str | None, max_tokens: int, temperature: float) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with connect(url, additional_headers=headers) as ws:
        created = json.loads(await ws.recv())
        print(f"connected to {created['model']} (session {created['session_id']}); Ctrl-C interrupts, Ctrl-D quits")
        if system:
            await ws.send(json.dumps({"type": "session.update", "system_prompt": system}))
            await ws.recv()
        loop = asyncio.get_running_loop()
        answering = asyncio.Event()

        def on_ctrl_c() -> None:
            if answering.is_set():
                asyncio.ensure_future(ws.send(json.dumps({"type": "interrupt"})))
            else:
                raise SystemExit(0)

        loop.add_signal_handler(signal.SIGINT, on_ctrl_c)
        turn = 0
        while True:
            try:
                line = await asyncio.to_thread(input, "\nyou> ")
            except EOFError:
                print()
                return
            if not line.strip():
                continue
            turn += 1
            request_id = f"turn-{turn}"
            sampling = {"max_tokens": max_tokens, "temperature": temperature}
            await ws.send(json.dumps({"type": "generate", "request_id": request_id, "user": line, "sampling": sampling}))
            answering.set()
            print("model> ", end="", flush=True)
            async for raw in ws:
                message = json.loads(raw)
                if message.get("request_id") != request_id:
                    continue
                if message["type"] == "delta":
                    print(message["text"], end="", flush=True)
                elif message["type"] == "done":
                    usage = message["usage"]
                    note = " [interrupted]" if message["interrupted"] else ""
                    print(f"{note}\n  ({usage['completion_tokens']} tokens, {usage['cached_tokens']} prompt tokens from cache, "
                          f"first token after {message['timings']['ttft_ms']:.0f} ms)")
                    break
                elif message["type"] == "error":
                    print(f"\n  error {message['code']}: {message['message']}")
                    break
            answering.clear()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/sessions")
    parser.add_argument("--system", help="system prompt for the session")
    parser.add_argument("--api-key")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    args = parser.parse_args()
    try:
        asyncio.run(chat(args.url, args.system, args.api_key, args.max_tokens, args.temperature))
    except (ConnectionRefusedError, OSError) as exc:
        print(f"cannot reach {args.url}: {exc} (start one with: cadenza serve)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
