"""Training drafters on the machine at hand: self-distillation data (:mod:`verispec.train.data`)
and Medusa heads (:mod:`verispec.train.medusa`)."""
