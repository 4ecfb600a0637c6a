"""Call the digits model with tritonclient, as a Triton or KServe user would.

`python client.py [host:port[/s/owner/name]] [model]`: with its defaults tritonclient
sends the input and asks for the outputs as binary tensors; then the same row as JSON.
Needs `pip install 'tritonclient[http]'`.
"""

import json
import sys
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

url = sys.argv[1] if len(sys.argv) > 1 else "localhost:8441"
model = sys.argv[2] if len(sys.argv) > 2 else "lee101/digits"
sample = json.loads((Path(__file__).resolve().parent / "model.json").read_text())["sample"]
x = np.asarray([sample["inputs"]], dtype=np.float32)

client = httpclient.InferenceServerClient(url)
print("metadata:", client.get_model_metadata(model))

binary = httpclient.InferInput("X", list(x.shape), "FP32")
binary.set_data_from_numpy(x)  # binary tensor data: tritonclient's default
result = client.infer(model, [binary])
print("binary:", result.as_numpy("label"), result.as_numpy("probabilities").round(4))

as_json = httpclient.InferInput("X", list(x.shape), "FP32")
as_json.set_data_from_numpy(x, binary_data=False)
outputs = [httpclient.InferRequestedOutput("label", binary_data=False)]
print("json:", client.infer(model, [as_json], outputs=outputs).get_response())
