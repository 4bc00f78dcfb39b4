"""See where precision goes: what a policy did to a model, where the time went, where fp16 breaks.

A library module like the rest of jamp: nothing here imports the training program (its
`__main__` is the command line, `python -m jamp.inspect --config=...`, and may).

* `jamp.inspect.report`: the static precision report of a traced (and compiled) step;
* `jamp.inspect.profile`: device time per module path and per dtype class, from a profiler trace;
* `jamp.inspect.ranges`: fp16 range hazards of activations and gradients on a real batch.
"""
