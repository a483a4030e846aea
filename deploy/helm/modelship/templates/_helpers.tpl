{{/*
Pod selector labels; the same three labels `modelship deploy render` puts on pods.
Call with (dict "root" $ "component" "engine").
*/}}
{{- define "modelship.selector" -}}
app.kubernetes.io/name: modelship
app.kubernetes.io/instance: {{ .root.Values.name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "modelship.labels" -}}
{{ include "modelship.selector" . }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end }}

{{- define "modelship.metadata" -}}
name: {{ .name }}
namespace: {{ .root.Values.namespace | default .root.Release.Namespace }}
labels:
  {{- include "modelship.labels" . | nindent 2 }}
{{- end }}

{{/* Engine metric names: vLLM's, with our prefix for our engine. */}}
{{- define "modelship.metricPrefix" -}}
{{- if eq .Values.engine.kind "vllm" }}vllm:{{ else }}modelship:{{ end }}
{{- end }}

{{/* preStop + the server's drain + room to exit. */}}
{{- define "modelship.terminationGrace" -}}
{{- add .Values.engine.drainDelaySeconds (ceil .Values.engine.gracePeriodSeconds | int) 15 }}
{{- end }}

{{/* Requests and limits; a GPU is a limit only. Call with (dict "resources" r "gpu" g). */}}
{{- define "modelship.resources" -}}
{{- $limits := dict }}
{{- range $key, $value := (.resources.limits | default dict) }}
{{- $_ := set $limits $key $value }}
{{- end }}
{{- with .gpu }}
{{- $_ := set $limits .resource (toString .count) }}
{{- end }}
{{- with .resources.requests }}
requests:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $limits }}
limits:
  {{- toYaml $limits | nindent 2 }}
{{- end }}
{{- end }}

{{/* Node affinity and tolerations for the GPU pool (nothing without a GPU). */}}
{{- define "modelship.gpuScheduling" -}}
{{- with .Values.engine.gpu }}
{{- if .nodeLabels }}
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        - matchExpressions:
            {{- range $key, $value := .nodeLabels }}
            - key: {{ $key }}
              operator: In
              values:
                - {{ $value | quote }}
            {{- end }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}

{{- define "modelship.probe" -}}
httpGet:
  path: {{ .path }}
  port: {{ .port }}
periodSeconds: {{ .period }}
failureThreshold: {{ .failures }}
timeoutSeconds: 2
{{- end }}

{{/* Startup and liveness on /health, readiness on .ready. Call with (dict "port" p "ready" path). */}}
{{- define "modelship.probes" -}}
startupProbe:
  {{- include "modelship.probe" (dict "path" "/health" "port" .port "period" 10 "failures" 90) | nindent 2 }}
livenessProbe:
  {{- include "modelship.probe" (dict "path" "/health" "port" .port "period" 10 "failures" 3) | nindent 2 }}
readinessProbe:
  {{- include "modelship.probe" (dict "path" .ready "port" .port "period" 5 "failures" 2) | nindent 2 }}
{{- end }}

{{- define "modelship.nonRoot" -}}
runAsNonRoot: true
runAsUser: 10001
allowPrivilegeEscalation: false
capabilities:
  drop:
    - ALL
{{- end }}

{{- define "modelship.preStop" -}}
preStop:
  exec:
    command:
      - sleep
      - {{ .Values.engine.drainDelaySeconds | toString | quote }}
{{- end }}

{{- define "modelship.prometheusAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ . | toString | quote }}
prometheus.io/path: /metrics
{{- end }}

{{/*
What engines serve, under /data/models/<slug>/: `production`, a pinned `releases/<n>`, or a
tier's `optimized/<variant>`. Call with (dict "release" n-or-nil "variant" v-or-nil).
*/}}
{{- define "modelship.serves" -}}
{{- if .variant }}optimized/{{ .variant }}{{ else if .release }}releases/{{ .release }}{{ else }}production{{ end }}
{{- end }}

{{/* Where the engine reads the model. Call with (dict "slug" s "release" n "variant" v). */}}
{{- define "modelship.modelPath" -}}
/data/models/{{ .slug }}/{{ include "modelship.serves" . }}
{{- end }}

{{- define "modelship.apiKeyEnv" -}}
{{- if .root.Values.apiKeySecret }}
- name: {{ .variable }}
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.apiKeySecret }}
      key: api-key
{{- end }}
{{- end }}
