"""The in-mesh transformation: DiLoCo and Streaming DiLoCo as an optax GradientTransformation."""
