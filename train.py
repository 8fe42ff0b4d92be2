"""MARS / AR-SFT training: `python train.py model=qwen2.5-7b block=4` (see conf/train.yaml, mars.cli.train)."""

from mars.cli.train import main

if __name__ == "__main__":
    main()
