"""Small random models for the model tests."""

from model.config import ModelConfig
from model.demo import init_weights
from model.transformer import Transformer


def tiny_model(seed: int = 0, **overrides: object) -> Transformer:
    fields = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_position=96)
    fields.update(overrides)
    model = Transformer(ModelConfig(**fields))
    init_weights(model, seed, std=0.1)
    return model.eval()
