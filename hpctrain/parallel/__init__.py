"""How the axes compose (``compose``), what an axis implementation gives
back to the core (``handles``), and how a step's gradients are finished
(``finalize``). Read ``compose.parallelize`` top to bottom to see how a
layout is built, and ``finalize.finalize_grads`` to see what happens to the
gradients between the last backward and the optimizer step."""
