"""OpenAI-compatible server: `python serve.py checkpoint=<dir> port=8000` (see conf/serve.yaml, docs/serving.md)."""

from mars.cli.serve import main

if __name__ == "__main__":
    main()
