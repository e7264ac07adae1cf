"""Talk to `tqexport serve` with the official openai client: a completion, then a streamed chat.

tqexport serve out/smollm2-turboquant_4bit_nc --served-model-name smollm2 &
python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --model smollm2
"""

import argparse

import openai


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="smollm2", help="the server's --served-model-name")
    p.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=120)

    print("models:", [m.id for m in client.models.list().data])
    r = client.completions.create(
        model=args.model, prompt="The capital of France is", max_tokens=16, temperature=0
    )
    print(f"completion ({r.choices[0].finish_reason}, {r.usage.completion_tokens} tokens):",
          repr(r.choices[0].text))  # fmt: skip

    stream = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": "Say hello in three words."}],
        max_tokens=16,
        stream=True,
    )
    print("chat, streamed: ", end="", flush=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
