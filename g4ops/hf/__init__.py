"""Everything in g4ops that knows HF transformers or peft (design.md section 2): `enable()`/`disable()` and the
module patches (patches.py), the shared tests of which modules may be replaced (modules.py), the "g4ops" attention
implementation and its masks (attention_interface.py), the fused-loss causal-LM forward (causal_lm.py), routing
`generate()` into g4ops.engine (generate.py), and peft's LoRA layers onto g4ops' LoRA ops (peft_lora.py). Below
it: the op layer (g4ops.ops: the core ops, lora, attention, loss) and the engine, which patch no transformers
class."""

from .generate import Route, generation_route
from .patches import disable, enable, is_enabled

__all__ = ["Route", "disable", "enable", "generation_route", "is_enabled"]
