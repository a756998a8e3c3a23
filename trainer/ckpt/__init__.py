"""What a run keeps and starts from: Orbax checkpoints, the checks of a resume, Hugging Face
import, and step 0's state."""
