"""Load the demo model, stream a chat answer, then ask a follow-up that reuses the prefix.

python examples/quickstart.py
"""

from __future__ import annotations

import qwen38_backend


def main() -> None:
    model = qwen38_backend.load("qwen38-demo")
    session = model.session()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    for follow_up in (None, "And of Germany?"):
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
        answer = []
        for event in session.generate(messages, max_tokens=64):
            if event.type == "text":
                answer.append(event.text)
                print(event.text, end="", flush=True)
            elif event.type == "done":
                print(f"\n[{event.finish_reason}] usage: {event.usage}")
        messages.append({"role": "assistant", "content": "".join(answer)})


if __name__ == "__main__":
    main()
