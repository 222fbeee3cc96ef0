"""LLM-as-judge reward: the policy answers (traced, trained on); the same engines then judge the answer
through the untraced endpoint, which is never recorded into the trajectory."""

from openai import AsyncOpenAI

from instar.agents import Env, Result, StepEnvRunner

JUDGE = "You are a judge. Reply correct or wrong."


class JudgedEnv(Env):
    async def step(self, state: dict) -> Result:
        question = state["observation_text"]  # the prompt (single turn)
        judge = AsyncOpenAI(base_url=state["untraced_base_url"], api_key=state["api_key"], max_retries=0)
        reply = await judge.chat.completions.create(
            model=state["model_name"], temperature=0.0, max_tokens=8,
            messages=[{"role": "system", "content": JUDGE},
                      {"role": "user", "content": f"Question: {question}\nAnswer: {state['action_text']}"}])
        await judge.close()
        verdict = (reply.choices[0].message.content or "").strip().lower()
        reward = 1.0 if verdict.startswith("correct") else 0.0
        return Result(reward=reward, score=reward, info={"verdict": verdict})


AgentRunner = StepEnvRunner(JudgedEnv)
