"""Operations on bands, built on the runtime: collectives (v-collectives and their autograd
forms), the halo exchange and its plan, window geometry, the distributed FFT, attention over
cut sequences, training helpers, forecast skill, and cutting/joining whole tensors (sharding)."""
