"""MLServer's side of the `inference protocol` scenario: an ONNX model as MLServer serves it.

MLServer 1.7 ships no ONNX runtime, so a user writes this custom runtime, the way its
documentation shows one (an MLModel with load and predict, the NumpyCodec for tensors),
with the same one-thread session polyserve's model spaces use.
"""

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxRuntime(MLModel):
    async def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        uri = await get_model_uri(self._settings)
        self._session = ort.InferenceSession(uri, options, providers=["CPUExecutionProvider"])
        self._outputs = [output.name for output in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feed = {tensor.name: NumpyCodec.decode_input(tensor) for tensor in payload.inputs}
        results = self._session.run(self._outputs, feed)
        return InferenceResponse(
            model_name=self.name,
            outputs=[
                NumpyCodec.encode_output(name, array)
                for name, array in zip(self._outputs, results, strict=True)
            ],
        )
